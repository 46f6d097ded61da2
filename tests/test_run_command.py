"""``llmexport-run``: a one-shot answer equals the runtime's own greedy ``generate``; a chat keeps
the conversation in the runtime's KV cache (two turns, /reset, a third turn) and streams exactly
the answers it reports; every bad input is one line on stderr with its exit code.

The command and the runtime references run in subprocesses (MNN can crash at interpreter exit);
the references end with ``os._exit``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llmexport import ExportOptions, export
from llmexport.mnn.config import RuntimeProfile
from llmexport.quant.scheme import QuantScheme

STATS = re.compile(r"^\[prefill \d+ tok, [\d.]+ tok/s \| decode \d+ tok, ([\d.]+|-) tok/s \| context \d+/\d+")
FIRST, SECOND = "Hello there, how are you?", "And what did you do yesterday?"
PLAIN = ["gemma4-31b", "llama3"]  # exports without per-layer embeddings


@pytest.fixture(scope="module")
def exports(tiny_decoder, tiny_gemma4, tmp_path_factory):
    """Tiny 4-bit exports on the exact profile (float kernels: a chunked prefill and a whole one
    agree to ~1e-6, so greedy ids can be compared across them); "llama3-fast" on the default fast
    profile, whose int8 activations make a chunked prefill differ (~0.1 logits): one-shot only."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            source = tiny_decoder("llama3") if name.startswith("llama3") else tiny_gemma4(name.split("-")[1],
                                                                                           text_only=True)
            profile = RuntimeProfile.FAST if name.endswith("-fast") else RuntimeProfile.EXACT
            out = tmp_path_factory.mktemp(f"run-{name}") / "out"
            export(source, out, ExportOptions(quant=QuantScheme(4, 64), runtime_profile=profile))
            cache[name] = out
        return cache[name]

    return get


@pytest.fixture(scope="module")
def tower_export(tmp_path_factory):
    """A tiny Gemma4 export with vision and audio towers, plus an image and a WAV file."""
    from llmexport.media.audio import samples_for_tokens, synthetic_clip, write_wav
    from llmexport.media.image import synthetic_image
    from llmexport.tiny.gemma4_towers import build_tiny_multimodal

    root = tmp_path_factory.mktemp("run-towers")
    out = root / "out"
    export(build_tiny_multimodal(root / "ckpt", "vision-audio-64"), out,
           ExportOptions(quant=QuantScheme(16, 64), runtime_profile=RuntimeProfile.EXACT))
    synthetic_image(96, 96).save(root / "image.png")
    write_wav(root / "clip.wav", synthetic_clip(samples_for_tokens(6)))
    return out, root / "image.png", root / "clip.wav"


def _run(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The command's exit code, stdout and stderr as UTF-8 text, line ends kept as written (an
    answer may hold a carriage return)."""
    proc = subprocess.run([sys.executable, "-m", "llmexport.run_cli", *map(str, args)],
                          input=None if stdin is None else stdin.encode(), capture_output=True, timeout=300,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8"),
                                       proc.stderr.decode("utf-8", "replace"))


def _turns(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _runtime(folder: Path, body: str) -> dict:
    """Run ``body`` against a fresh runtime instance ``c`` of ``folder``; it sets ``result``."""
    script = textwrap.dedent("""
        import json, os, sys
        import numpy as np
        import MNN.llm as llm
        c = llm.create(sys.argv[1])._c_obj
        assert c.load()
        def token_bytes(i):
            try:
                return c.tokenizer_decode(i).encode()
            except UnicodeDecodeError as exc:
                return exc.object
        def stops(i):
            c.set_context({"current_token": i})
            return bool(c.stoped())
        def greedy(ids, steps):
            logits, out = c.forward(ids), []
            for _ in range(steps):
                token = int(np.argmax(np.asarray(logits.read()).reshape(-1)))
                if stops(token):
                    break
                out.append(token)
                logits = c.forward([token])
            return out
        result = None
    """) + textwrap.dedent(body) + textwrap.dedent("""
        with open(sys.argv[2], "w") as f:
            json.dump(result, f)
        sys.stdout.flush()
        os._exit(0)
    """)
    out = folder.parent / f"runtime-{os.getpid()}-{abs(hash(body))}.json"
    proc = subprocess.run([sys.executable, "-c", script, str(folder / "config.json"), str(out)],
                          capture_output=True, text=True, errors="replace", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def _generate(folder: Path, content: str, steps: int) -> dict:
    """The runtime's own greedy generate on the templated one-message conversation."""
    return _runtime(folder, f"""
        text = c.apply_chat_template([{{"role": "user", "content": {content!r}}}])
        out = [int(i) for i in c.generate([int(i) for i in c.tokenizer_encode(text)], {steps})]
        if out and stops(out[-1]):
            out = out[:-1]
        result = {{"ids": out, "text": b"".join(token_bytes(i) for i in out).decode("utf-8", "replace")}}
    """)


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAIN + ["llama3-fast"])
def test_one_shot_answer_is_the_runtimes_greedy_generate(exports, tmp_path, name):
    folder, transcript = exports(name), tmp_path / "t.jsonl"
    proc = _run(folder, "--prompt", FIRST, "--max_new_tokens", 40, "--transcript", transcript)
    assert proc.returncode == 0, proc.stderr
    want = _generate(folder, FIRST, 40)
    (turn,) = _turns(transcript)
    assert turn["ids"] == want["ids"] and len(want["ids"]) > 0
    assert proc.stdout == want["text"] + "\n"  # only the answer on stdout
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 1 and STATS.match(stats[0]), proc.stderr
    assert turn["stats"]["decode_tokens"] == len(turn["ids"]) - (turn["stop"] == "context")


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAIN + ["gemma4-e2b"])
def test_chat_keeps_the_conversation_in_the_kv_cache(exports, tmp_path, name):
    folder, transcript = exports(name), tmp_path / "t.jsonl"
    proc = _run(folder, "--max_new_tokens", 24, "--transcript", transcript,
                stdin=f"{FIRST}\n{SECOND}\n/reset\n{FIRST}\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    one, two, reset, three = _turns(transcript)
    assert reset == {"reset": True}
    # what streamed is what each turn reports (decoded in one piece by the child)
    assert proc.stdout == "".join(turn["text"] + "\n" for turn in (one, two, three))
    # after /reset the same message gets the same answer from the same (empty) cache
    assert three["ids"] == one["ids"] and three["context_ids"] == one["context_ids"]
    # turn two prefilled only what the cache lacked: turn one's prompt and answer stay
    kept = one["context_ids"] + one["ids"]
    assert two["context_ids"][:len(kept)] == kept
    assert two["stats"]["prompt_tokens"] == len(two["context_ids"]) - len(kept) > 0
    # the cache holds the templated conversation, and a fresh instance given it answers alike
    want = _fresh_replay(folder, one, two)
    assert want["cached"] == want["template"]
    assert want["answer"] == two["ids"]
    assert len([line for line in proc.stderr.splitlines() if STATS.match(line)]) == 3


@pytest.mark.slow
def test_media_prompt_is_the_runtimes_own(tower_export, tmp_path):
    folder, image, clip = tower_export
    transcript = tmp_path / "t.jsonl"
    proc = _run(folder, "--prompt", "Describe both.", "--image", image, "--audio", clip, "--max_new_tokens", 16,
                "--transcript", transcript)
    assert proc.returncode == 0, proc.stderr
    (turn,) = _turns(transcript)
    content = f"<img>{image}</img><audio>{clip}</audio>Describe both."
    assert turn["user"] == content
    want = _generate(folder, content, 16)
    assert turn["ids"] == want["ids"] and proc.stdout == want["text"] + "\n"
    assert turn["stats"]["prompt_tokens"] > 20  # the towers' soft tokens are in the prompt


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _set_context(folder: Path, tokens: int) -> None:
    config = json.loads((folder / "llm_config.json").read_text())
    config["max_position_embeddings"] = tokens
    (folder / "llm_config.json").write_text(json.dumps(config))


def _bad_cases(exports, tower, tmp: Path):
    good = exports("llama3")
    towers, image, clip = tower
    (tmp / "empty").mkdir()
    no_graph = _copy(good, tmp / "no-graph")
    (no_graph / "llm.mnn").unlink()
    weight = _copy(good, tmp / "weight")
    _truncate(weight / "llm.mnn.weight", 0.9)
    table = _copy(good, tmp / "table")
    _truncate(table / "embeddings_bf16.bin", 0.5)
    graph = _copy(good, tmp / "graph")
    _truncate(graph / "llm.mnn", 0.5)
    short = _copy(good, tmp / "short")
    _set_context(short, 16)
    (tmp / "notes.png").write_text("not an image")
    return {
        "missing folder": ([tmp / "nowhere"], 3, r"nowhere: no such folder$"),
        "not an export": ([tmp / "empty"], 3, r"empty: not an MNN export \(no config\.json\)$"),
        "no graph": ([no_graph], 3, r"no-graph: not an MNN export \(no llm\.mnn\)$"),
        "truncated weights": ([weight], 3, r"llm\.mnn\.weight: \d+ bytes, but llm\.mnn reads up to byte \d+ "),
        "truncated table": ([table], 3, r"embeddings_bf16\.bin: \d+ bytes, \d+ expected for 512 rows"),
        "corrupt graph": ([graph], 3, r"llm\.mnn: not a valid MNN graph \(MNN.s verifier refuses it"),
        "prompt over context": ([short], 2, r"needs \d+ tokens, more than the export's context of 16 "),
        "image without tower": ([good, "--image", image], 2, r"this export has no image tower"),
        "audio without tower": ([good, "--audio", clip], 2, r"this export has no audio tower"),
        "missing image": ([towers, "--image", tmp / "gone.png"], 2, r"gone\.png: no such image file$"),
        "missing audio": ([towers, "--audio", tmp / "gone.wav"], 2, r"gone\.wav: no such audio file$"),
        "not an image": ([towers, "--image", tmp / "notes.png"], 2, r"notes\.png: not an image MNN's runtime decodes"),
        "not a wav": ([towers, "--audio", image], 2, r"image\.png: not a WAV file"),
        "zero tokens": ([good, "--max_new_tokens", 0], 2, r"--max_new_tokens"),
    }


@pytest.mark.slow
def test_bad_input_is_one_line_and_an_exit_code(exports, tower_export, tmp_path):
    for case, (args, code, message) in _bad_cases(exports, tower_export, tmp_path).items():
        proc = _run(*args, "--prompt", "Hello " * 10, "--quiet")
        assert proc.returncode == code, (case, proc.returncode, proc.stderr)
        assert proc.stdout == "", case
        lines = proc.stderr.strip().splitlines()
        if case != "zero tokens":  # click's own usage error (usage line, hint, message)
            assert len(lines) == 1 and lines[0].startswith("llmexport-run: error: "), (case, proc.stderr)
        assert re.search(message, lines[-1]), (case, lines[-1])
        assert "Traceback" not in proc.stderr, case


@pytest.mark.slow
def test_chat_refuses_a_message_over_the_context_and_goes_on(exports, tmp_path):
    folder = _copy(exports("llama3"), tmp_path / "short")
    _set_context(folder, 48)
    transcript = tmp_path / "t.jsonl"
    proc = _run(folder, "--max_new_tokens", 8, "--quiet", "--transcript", transcript,
                stdin="word " * 60 + "\nHi\nHi again, with a longer message\n")
    assert proc.returncode == 0, proc.stderr
    errors = proc.stderr.strip().splitlines()
    assert len(errors) >= 1 and "more than the export's context of 48" in errors[0]
    turns = _turns(transcript)
    assert [t["user"] for t in turns][0] == "Hi" and all(len(t["context_ids"]) <= 48 for t in turns)
    # the answer stops where the context ends, or a later message is refused: never past 48 tokens
    assert all(t["stats"]["context_tokens"] <= 48 for t in turns)


@pytest.mark.slow
def test_a_runtime_that_dies_is_one_error(exports, tmp_path):
    from llmexport.errors import ConversionError
    from llmexport.mnn.chat import ChatSession
    from llmexport.mnn.export_check import check_export

    session = ChatSession(check_export(exports("llama3")))
    try:
        session._proc.send_signal(signal.SIGSEGV)
        with pytest.raises(ConversionError, match=r"MNN's runtime was killed by SIGSEGV while (answering|receiving)"):
            session.ask("Hi", 4)
    finally:
        session.kill()


@pytest.mark.slow
def test_get_context_crashes_on_an_answer_that_is_not_utf8(exports):
    """Why the command never calls ``get_context()``: the binding puts ``PyUnicode_FromString(
    generate_str)`` into the dict unchecked (pymnn/src/llm.h), a NULL for bytes that are not UTF-8,
    and the process dies. The same prompt through llmexport-run answers (U+FFFD for the bytes)."""
    folder = exports("llama3")
    script = textwrap.dedent("""
        import os, sys
        import MNN.llm as llm
        c = llm.create(sys.argv[1])._c_obj
        c.load()
        ids = [int(i) for i in c.tokenizer_encode(c.apply_chat_template([{"role": "user", "content": sys.argv[2]}]))]
        out = c.generate(ids, 64)
        def token_bytes(i):
            try:
                return c.tokenizer_decode(i).encode()
            except UnicodeDecodeError as exc:
                return exc.object
        try:
            b"".join(token_bytes(i) for i in out).decode("utf-8")
            valid = True
        except UnicodeDecodeError:
            valid = False
        print("VALID" if valid else "INVALID", flush=True)
        c.get_context()
        print("SURVIVED", flush=True)
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(folder / "config.json"), FIRST], capture_output=True,
                          text=True, errors="replace", timeout=300)
    assert "INVALID" in proc.stdout, proc.stdout  # the random model's answer holds stray bytes
    assert proc.returncode == -signal.SIGSEGV and "SURVIVED" not in proc.stdout
    answer = _run(folder, "--prompt", FIRST, "--max_new_tokens", 64, "--quiet")
    assert answer.returncode == 0 and "\ufffd" in answer.stdout


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_exits_and_stops_the_runtime(exports, signum):
    """Ctrl-C (and SIGTERM) at the prompt: exit 128+N, one line, and no runtime process left behind."""
    proc = subprocess.Popen([sys.executable, "-m", "llmexport.run_cli", str(exports("llama3"))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    banner = [proc.stderr.readline() for _ in range(3)]  # loading, loaded, the commands: the runtime is up
    assert banner[2].startswith("type a message"), banner
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    assert err.strip().splitlines()[-1].startswith("llmexport-run: ")
    assert not _alive(int(children[0]))


def _alive(pid: int) -> bool:
    for _ in range(50):  # an orphan is reaped by init shortly after
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
def test_chat_takes_media_in_a_later_message(tower_export, tmp_path):
    """A typed ``<img>`` tag in the second message: a missing file is refused (the chat goes on), an
    existing one is run by the vision tower, and the answer is what a fresh instance gives for the
    same cached ids and the same image."""
    folder, image, _ = tower_export
    transcript = tmp_path / "t.jsonl"
    proc = _run(folder, "--max_new_tokens", 12, "--quiet", "--transcript", transcript,
                stdin=f"Hi\n<img>{tmp_path / 'gone.png'}</img>What is this?\n<img>{image}</img>What is this?\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"llmexport-run: error: {tmp_path / 'gone.png'}: no such image file"]
    one, two = _turns(transcript)
    kept = one["context_ids"] + one["ids"]
    assert two["context_ids"][:len(kept)] == kept and two["stats"]["prompt_tokens"] > 20  # soft tokens
    want = _runtime(folder, f"""
        c.tokenizer_encode("<img>{image}</img>")  # the tower's embedding for the pad run in the ids
        result = greedy({two["context_ids"]!r}, {len(two["ids"])})
    """)
    assert want == two["ids"]


#: chat templates that do not just extend the rendered conversation: the answer is rewritten
#: (the cache is cut back inside the answer), or only the last message is rendered (cut back to the
#: common prefix, the template's header)
HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"
TEMPLATES = {
    "rewrites answers": "{{ bos_token }}{% for message in messages %}" + HEADER.format(role="{{ message['role'] }}")
                        + "{% if message['role'] == 'assistant' %}OK{% else %}{{ message['content'] }}{% endif %}"
                        "<|eot_id|>{% endfor %}{% if add_generation_prompt %}" + HEADER.format(role="assistant")
                        + "{% endif %}",
    "last message only": "{{ bos_token }}" + HEADER.format(role="user") + "{{ messages[-1]['content'] }}<|eot_id|>"
                         + HEADER.format(role="assistant"),
}


@pytest.mark.slow
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_chat_cuts_the_cache_back_where_the_template_changes_history(exports, tmp_path, template):
    folder = _copy(exports("llama3"), tmp_path / "export")
    config = json.loads((folder / "llm_config.json").read_text())
    config["jinja"]["chat_template"] = TEMPLATES[template]
    (folder / "llm_config.json").write_text(json.dumps(config))
    transcript = tmp_path / "t.jsonl"
    proc = _run(folder, "--max_new_tokens", 16, "--quiet", "--transcript", transcript, stdin=f"{FIRST}\n{SECOND}\n")
    assert proc.returncode == 0, proc.stderr
    one, two = _turns(transcript)
    kept = one["context_ids"] + one["ids"]
    reused = len(two["context_ids"]) - two["stats"]["prompt_tokens"]
    assert 0 < reused < len(kept) and two["context_ids"][:reused] == kept[:reused]  # cut back, not reset
    want = _fresh_replay(folder, one, two)
    assert want["cached"] == want["template"] and want["answer"] == two["ids"]


def _fresh_replay(folder, one: dict, two: dict) -> dict:
    """A fresh instance's view of turn two: the template's text of the conversation, the text of
    the ids the chat's cache held, and its greedy answer from those ids."""
    return _runtime(folder, f"""
        messages = [{{"role": "user", "content": {FIRST!r}}}, {{"role": "assistant", "content": {one["text"]!r}}},
                    {{"role": "user", "content": {SECOND!r}}}]
        ids = {two["context_ids"]!r}
        result = {{"template": c.apply_chat_template(messages),
                  "cached": b"".join(token_bytes(i) for i in ids).decode("utf-8", "replace"),
                  "answer": greedy(ids, {len(two["ids"])})}}
    """)


def test_console_script_is_installed():
    """``make install`` (pip install -e) puts ``llmexport-run`` beside the interpreter: a fresh clone has it."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "llmexport-run"]
    assert script.value == "llmexport.run_cli:main"
    installed = Path(sys.executable).parent / "llmexport-run"
    proc = subprocess.run([str(installed), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--prompt" in proc.stdout
