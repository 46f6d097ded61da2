"""Drive MNN's LLM runtime (``MNN.llm``) and single exported graphs in a child process.

The runtime can crash at interpreter exit, so every request runs in a child process that ends
with ``os._exit``; results come back as .npy files in a temporary folder. A single-prompt check
uses a fresh instance per pass, so it sees nothing of earlier requests (as does each window of
``run_windows``, the quality benchmark's scoring); ``run_chat`` checks a
conversation in one instance (several turns on one KV cache, then ``reset()`` and a new
conversation). Exports made before the token table (mnn/token_table.py) failed exactly there.

Each request is a ``Call`` (its JSON request and how its folder is read back); ``run_calls`` runs
several in ONE child, one after the other (a batch: the child's start and its imports are paid once,
which is what an emulated ARM child costs most, mnn/arm/machine.py). The ``machine`` says where
the child runs: this host's Python (``HOST``) or MNN's ARM kernels. The child side imports only
numpy, MNN and llmexport's torch-free modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import numpy as np

from llmexport.errors import ConversionError
from llmexport.mnn.arm.machine import HOST, Machine
from llmexport.mnn.config import cache_can_be_cut

T = TypeVar("T")
#: runtime output lines that are no failure's reason
_CHATTER = ("[MNNLLM]", "The device supports")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One runtime request (``mode`` and its fields; ``run_calls`` adds ``out``, its folder) and how
    its result is read from that folder: ``read(folder, failure)``, ``failure`` None when the child
    completed it, else why not (the exit status and the child's last lines)."""

    request: dict[str, Any]
    read: Callable[[Path, "str | None"], T]


def _spawn(request: dict[str, Any], machine: Machine, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(machine.command("llmexport.mnn.runtime"), input=json.dumps(request), capture_output=True,
                          text=True, timeout=timeout, errors="replace", env=machine.environment())


def _failure(proc: subprocess.CompletedProcess, out: Path) -> str:
    failed = out / "failed.txt"
    if failed.exists():
        lines = failed.read_text().strip().splitlines()
    else:
        lines = [line for line in (proc.stdout + proc.stderr).strip().splitlines() if not line.startswith(_CHATTER)]
    return f"exit {proc.returncode}: " + " | ".join(lines[-4:])


def run_calls(calls: Sequence[Call[Any]], machine: Machine = HOST, timeout: float | None = None,
              output: list[str] | None = None) -> list[Any]:
    """Each call's result, all calls run in one child in turn (each in its own fresh instances);
    ``timeout``: for the whole child (default 600 s a call). A call that raises in the child does not
    stop the later ones; a crash does (they read as failed). ``output`` receives the child's output
    lines (MNN's log: the kernels it found)."""
    if not calls:
        return []
    with tempfile.TemporaryDirectory(prefix="llmexport-mnn-") as tmp:
        requests = []
        for i, call in enumerate(calls):
            (Path(tmp) / str(i)).mkdir()
            requests.append({**call.request, "out": str(Path(tmp) / str(i))})
        request = requests[0] if len(requests) == 1 else {"mode": "batch", "requests": requests}
        proc = _spawn(request, machine, timeout or 600.0 * len(calls))
        if output is not None:
            output.extend((proc.stdout + proc.stderr).splitlines())
        results = []
        for call, req in zip(calls, requests):
            out = Path(req["out"])
            results.append(call.read(out, None if (out / "result.json").exists() else _failure(proc, out)))
        return results


def _checked(what: str, read: Callable[[Path], T]) -> Callable[[Path, "str | None"], T]:
    """A reader that turns a failure into ConversionError naming ``what``."""
    def checked(out: Path, failure: str | None) -> T:
        if failure is not None:
            raise ConversionError(f"MNN runtime failed on {what} ({failure})")
        return read(out)

    return checked


@dataclass
class RuntimeRun:
    """Logits of a teacher-forced pass and a greedy continuation from MNN's runtime."""

    forced_logits: np.ndarray  # [steps, vocab]: after the prompt, then after each forced token
    greedy_ids: list[int]
    encoded: dict[str, list[int]]  # text -> ids from the runtime's tokenizer


def runtime_call(export_dir: Path, prompt_ids: list[int], forced_ids: list[int] | None, greedy_steps: int,
                 texts: Sequence[str] = (), config: dict[str, Any] | None = None) -> Call[RuntimeRun]:
    """``run_runtime`` as a call (for ``run_calls``)."""
    def read(out: Path) -> RuntimeRun:
        meta = json.loads((out / "result.json").read_text())
        return RuntimeRun(np.load(out / "forced.npy"), meta["greedy"], meta["encoded"])

    request = {"config": str(export_dir / "config.json"), "prompt": prompt_ids, "forced": forced_ids,
               "greedy": greedy_steps, "texts": list(texts), "set_config": config or {"thread_num": 2}}
    return Call(request, _checked(str(export_dir), read))


def run_runtime(export_dir: Path, prompt_ids: list[int], forced_ids: list[int] | None, greedy_steps: int,
                texts: Sequence[str] = (), config: dict[str, Any] | None = None, timeout: float = 600,
                machine: Machine = HOST) -> RuntimeRun:
    """The runtime's logits after ``prompt_ids`` and after each of ``forced_ids`` (None: after each
    of its own greedy ids but the last), its ``greedy_steps`` greedy ids, and how its tokenizer
    encodes ``texts``."""
    return run_calls([runtime_call(export_dir, prompt_ids, forced_ids, greedy_steps, texts, config)], machine,
                     timeout)[0]


@dataclass
class MediaRun:
    """A prompt with media tags (``<img>...</img>``, ``<audio>...</audio>``) run by the runtime:
    the ids its tokenizer/towers produced, teacher-forced logits and a greedy continuation."""

    ids: list[int]
    forced_logits: np.ndarray  # [steps, vocab]: after the prompt, then after each forced token
    greedy_ids: list[int]


def run_media_prompt(export_dir: Path, prompt: str, forced_ids: list[int] | None, greedy_steps: int,
                     config: dict[str, Any] | None = None, timeout: float = 600,
                     machine: Machine = HOST) -> MediaRun:
    """Run a templated prompt carrying media tags; the runtime's towers turn each tag into
    soft tokens (MNN 3.6.1 ``Omni::tokenizer_encode``). A fresh instance per pass, as for text."""
    def read(out: Path) -> MediaRun:
        meta = json.loads((out / "result.json").read_text())
        return MediaRun(meta["ids"], np.load(out / "forced.npy"), meta["greedy"])

    request = {"mode": "media", "config": str(export_dir / "config.json"), "prompt": prompt,
               "forced": forced_ids, "greedy": greedy_steps, "set_config": config or {"thread_num": 2}}
    return run_calls([Call(request, _checked(str(export_dir), read))], machine, timeout)[0]


#: config.json's names of MNN's BackendConfig modes (include/MNN/MNNForwardType.h)
_PRECISION = {"normal": 0, "high": 1, "low": 2}
_MEMORY = {"normal": 0, "high": 1, "low": 2}
_DYNAMIC_QUANT_OPTIONS = 5  # Interpreter::HintMode, what the LLM engine sets from "dynamic_option"


def run_module(model: Path, inputs: list[dict[str, np.ndarray]], outputs: list[str], thread_num: int = 2,
               timeout: float = 600, settings: dict[str, Any] | None = None,
               machine: Machine = HOST) -> list[dict[str, np.ndarray]]:
    """Run one exported graph (e.g. ``visual.mnn``) with fp32 activations on each of several input
    sets (one child process, one module load); returns the named outputs per input set.

    ``settings`` (config.json's ``precision``, ``memory``, ``dynamic_option``) runs the graph on a
    runtime built from them and ``thread_num``, as the LLM engine builds one; without it the module
    loads at precision and memory normal on pymnn's default runtime (which ignores ``thread_num``)."""
    with tempfile.TemporaryDirectory(prefix="llmexport-mnn-") as feeds:
        for r, feed in enumerate(inputs):
            for i, value in enumerate(feed.values()):
                np.save(Path(feeds) / f"in{r}_{i}.npy", value)
        request = {"mode": "module", "model": str(model), "inputs": list(inputs[0]), "outputs": outputs,
                   "runs": len(inputs), "thread_num": thread_num, "settings": settings, "feeds": feeds}

        def read(out: Path) -> list[dict[str, np.ndarray]]:
            return [{name: np.load(out / f"out{r}_{i}.npy") for i, name in enumerate(outputs)}
                    for r in range(len(inputs))]

        return run_calls([Call(request, _checked(str(model), read))], machine, timeout)[0]


def run_windows(export_dir: Path, windows: Sequence[Sequence[int]], config: dict[str, Any] | None = None,
                timeout: float = 1800, machine: Machine = HOST) -> list[np.ndarray]:
    """Each window's logits ``[len(window) - 1, vocab]`` (position ``i`` predicting token ``i + 1``),
    every window in a fresh instance: its first token, then the others fed one at a time (one
    child process for all windows)."""
    return list(score_windows(export_dir, windows, config, timeout, machine))


def score_windows(export_dir: Path, windows: Sequence[Sequence[int]], config: dict[str, Any] | None = None,
                  timeout: float = 1800, machine: Machine = HOST) -> Iterator[np.ndarray]:
    """``run_windows``, one window's logits at a time (the others stay on disk meanwhile)."""
    with tempfile.TemporaryDirectory(prefix="llmexport-mnn-") as tmp:
        request = {"mode": "score", "config": str(export_dir / "config.json"), "out": tmp,
                   "set_config": config or {"thread_num": 2}, "windows": [[int(t) for t in w] for w in windows]}
        proc = _spawn(request, machine, timeout)
        if not (Path(tmp) / "result.json").exists():
            raise ConversionError(f"MNN runtime failed on {export_dir} ({_failure(proc, Path(tmp))})")
        for i in range(len(windows)):
            yield np.load(Path(tmp) / f"window{i}.npy")


@dataclass
class ChatTurnRun:
    """One chat turn in a runtime instance that keeps its KV cache between turns.

    ``messages``: the history the turn was asked with (ending with the user's message; earlier
    answers as the runtime streamed them); ``ids``: the runtime's rendering (``apply_chat_template``)
    and tokenization of it; ``kept``: the tokens of its KV cache from earlier turns it kept (a common
    prefix), so ``len(ids) - kept`` were prefilled; ``answer``: its greedy answer through ``generate``
    (a final stop token included when ``stopped``); ``pieces``: each streamed token's
    ``tokenizer_decode`` bytes (``ArGeneration`` streams them in turn; the binding's C strings end at
    a NUL byte, so a piece holding one comes back cut there); ``logits``:
    ``[len(answer), vocab]``, the same new tokens prefilled again on the same kept cache, then the
    answer fed token by token (the logits each answer token was chosen from).
    """

    messages: list[dict[str, str]]
    ids: list[int]
    kept: int
    answer: list[int]
    stopped: bool
    pieces: list[bytes]
    logits: np.ndarray

    @property
    def streamed(self) -> bytes:
        return b"".join(self.pieces)


@dataclass
class ChatRun:
    """The turns a conversation run completed; ``error`` says why it stopped early (the turn
    that failed is the next one)."""

    turns: list[ChatTurnRun]
    error: str | None = None


#: what a chat keeps between calls: the KV cache across ``generate_init`` (``Llm::generate_init``
#: clears it unless ``reuse_kv``), and greedy sampling whatever the shipped sampler says
CHAT_CONFIG: dict[str, Any] = {"reuse_kv": True, "sampler_type": "greedy"}


def chat_call(export_dir: Path, conversations: Sequence[Sequence[str]], steps: int,
              config: dict[str, Any] | None = None) -> Call[ChatRun]:
    """``run_chat`` as a call (for ``run_calls``)."""
    def read(out: Path, failure: str | None) -> ChatRun:
        turns: list[ChatTurnRun] = []
        while (out / f"turn{len(turns)}.json").exists():
            meta = json.loads((out / f"turn{len(turns)}.json").read_text())
            turns.append(ChatTurnRun(meta["messages"], meta["ids"], meta["kept"], meta["answer"], meta["stopped"],
                                     [bytes.fromhex(p) for p in meta["pieces"]],
                                     np.load(out / f"turn{len(turns)}.npy")))
        return ChatRun(turns, None if failure is None else f"MNN's runtime failed ({failure})")

    request = {"mode": "chat", "config": str(export_dir / "config.json"), "steps": steps,
               "set_config": {**(config or {"thread_num": 2}), **CHAT_CONFIG},
               "conversations": [list(c) for c in conversations]}
    return Call(request, read)


def run_chat(export_dir: Path, conversations: Sequence[Sequence[str]], steps: int,
             config: dict[str, Any] | None = None, timeout: float = 600, machine: Machine = HOST) -> ChatRun:
    """Chat in ONE runtime instance: the user messages of each conversation in turn, the runtime's
    answers (at most ``steps`` tokens) kept as the history; each turn renders the whole history with
    the runtime's template and prefills only what its KV cache lacks; ``reset()`` between
    conversations. A runtime failure (an exception or a crash) ends the run; the turns before it are
    returned."""
    return run_calls([chat_call(export_dir, conversations, steps, config)], machine, timeout)[0]


def _instance(request: dict[str, Any]):
    import MNN.llm as llm

    model = llm.create(request["config"])
    model.set_config(request["set_config"])
    model.load()
    return model


def _logits(var) -> np.ndarray:
    # read() can alias the runtime's output buffer, which the next forward overwrites.
    return np.array(var.read(), dtype=np.float32, copy=True).reshape(-1)


def _passes(request: dict[str, Any], prompt: Any, out: Path) -> tuple[list[int], list[int], Any]:
    """The prompt's ids, its greedy continuation and the last instance; the logits after the prompt
    and after each forced id go to ``forced.npy``. With ``forced`` None they follow the greedy ids
    themselves (one pass: teacher forcing on its own greedy ids is the greedy pass); otherwise a
    fresh instance runs each pass. ``prompt``: ids, or a text the runtime's tokenizer (and towers)
    encode."""
    def start() -> tuple[Any, list[int], np.ndarray]:
        model = _instance(request)
        ids = [int(i) for i in (model.tokenizer_encode(prompt) if isinstance(prompt, str) else prompt)]
        return model, ids, _logits(model.forward(ids))

    model, ids, logits = start()
    forced, greedy = [logits], []
    if request["forced"] is not None:
        forced += [_logits(model.forward([token])) for token in request["forced"]]
        if not request["greedy"]:  # no greedy pass: no fresh instance for it
            np.save(out / "forced.npy", np.stack(forced))
            return ids, [], model
        del model  # before the fresh instance loads (see module docstring): two would double the peak
        model, _, logits = start()
    for step in range(request["greedy"]):
        greedy.append(int(np.argmax(logits)))
        if step + 1 < request["greedy"]:
            logits = _logits(model.forward([greedy[-1]]))
            if request["forced"] is None:
                forced.append(logits)
    np.save(out / "forced.npy", np.stack(forced))
    return ids, greedy, model


def _child(request: dict[str, Any]) -> None:
    out = Path(request["out"])
    _, greedy, model = _passes(request, request["prompt"], out)
    encoded = {text: [int(i) for i in model.tokenizer_encode(text)] for text in request["texts"]}
    (out / "result.json").write_text(json.dumps({"greedy": greedy, "encoded": encoded}))


def _media_child(request: dict[str, Any]) -> None:
    ids, greedy, _ = _passes(request, request["prompt"], Path(request["out"]))
    (Path(request["out"]) / "result.json").write_text(json.dumps({"ids": ids, "greedy": greedy}))


def _score_child(request: dict[str, Any]) -> None:
    out = Path(request["out"])
    for i, window in enumerate(request["windows"]):
        model = _instance(request)
        logits = [_logits(model.forward([token])) for token in window[:-1]]
        np.save(out / f"window{i}.npy", np.stack(logits))
        del model  # one instance at a time
    (out / "result.json").write_text("{}")


def _decoded(model, token: int) -> bytes:
    # The binding builds a str from the runtime's bytes; a token that ends inside a UTF-8
    # sequence raises, and the exception still carries the bytes.
    try:
        return model.tokenizer_decode(token).encode()
    except UnicodeDecodeError as exc:
        return bytes(exc.object)


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items two sequences (ids, text) share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _rewind(model, cached: int, keep: int, cut: bool, ids: Sequence[int],
            ready: Callable[[Sequence[int]], Sequence[int]] = list) -> int:
    """Drop the KV cache after its first ``keep`` tokens (``Llm::eraseHistory``), and make the
    instance ready for the next call (``generate_init`` keeps the cache under ``reuse_kv``).
    Without ``cut`` (an export with recurrent state, mnn/config.py ``cache_can_be_cut``) a shorter
    history is never erased to: the instance is reset and the kept prefix ``ids[:keep]`` prefilled
    again, so that the turn's own prefill still continues a carried state across calls (a prefix
    of one id is not replayed: the whole history is then prefilled; ``ready``: what the replay feeds,
    see ``_chat_child``). Returns the tokens kept."""
    if keep < cached:
        if cut:
            model._c_obj.erase_history(keep, 0)
        else:
            model.reset()
            if keep >= 2:
                model.forward(list(ready(ids[:keep])))
            else:
                keep = 0
    model._c_obj.generate_init()
    return keep


def _prefill_ids(ids: list[int], kept: int, cut: bool) -> list[int]:
    """The ids a turn prefills; a recurrent state zeroes only on a multi-token call after
    ``reset()`` (CPULinearAttention::onResize), so such an export never starts with one id."""
    if not cut and kept == 0 and len(ids) < 2:
        raise RuntimeError("a fresh sequence of one id: the runtime would keep the recurrent state of the last one")
    return ids[kept:]


def _chat_child(request: dict[str, Any]) -> None:
    """Each turn: the greedy answer through ``generate`` on the runtime's own rendering (the chat
    itself), then the same new tokens prefilled again and the answer fed back (its logits)."""
    out = Path(request["out"])
    model = _instance(request)
    config = json.loads(model._c_obj.dump_config())
    # A multi-token input gives each run of media placeholder ids the next media embedding of the
    # last encode, unchecked (Omni::embedding): such ids from an answer stay out of the history.
    media = {config[key] for key in ("image_pad", "audio_pad") if isinstance(config.get(key), int)}
    cut = cache_can_be_cut(config)
    index = 0
    for number, users in enumerate(request["conversations"]):
        if number:
            model.reset()
        cache: list[int] = []  # the tokens in the runtime's KV cache
        messages: list[dict[str, str]] = []
        for user in users:
            messages = messages + [{"role": "user", "content": user}]
            rendered = model.apply_chat_template(messages)
            ids = [int(i) for i in model.tokenizer_encode(rendered)]

            def ready(part: Sequence[int], rendered: str = rendered) -> list[int]:
                # Omni keeps the last encode's media embeddings (a prefill consumes them) and M-RoPE
                # table (a prefill reads it from its head, moved on by all_seq_len): a part with media
                # ids (the history's start) needs the history encoded again; a text part gets a text
                # table, as a chat app encoding only the new text has (Llm::response's prompt cache)
                if media:
                    model.tokenizer_encode(rendered if media.intersection(part) else "")
                return list(part)

            kept = _rewind(model, len(cache), min(common_prefix_length(cache, ids), len(ids) - 1), cut, ids, ready)
            answer = [int(t) for t in model._c_obj.generate(ready(_prefill_ids(ids, kept, cut)), int(request["steps"]))]
            if not answer:
                raise RuntimeError(f"generate() returned no token after {len(ids) - kept} prefilled ones")
            stopped = bool(model.stoped())
            fed = answer[:-1] if stopped else answer  # a stop token is sampled, never fed back
            pieces = [_decoded(model, t) for t in fed]
            again = _rewind(model, len(ids) + len(fed), kept, cut, ids, ready)
            logits = [_logits(model.forward(ready(_prefill_ids(ids, again, cut))))] + \
                [_logits(model.forward([t])) for t in answer[:-1]]
            cache = ids + answer[:-1]
            np.save(out / f"turn{index}.npy", np.stack(logits))
            (out / f"turn{index}.json").write_text(json.dumps({
                "messages": messages, "ids": ids, "kept": kept, "answer": answer, "stopped": stopped,
                "pieces": [piece.hex() for piece in pieces]}))
            index += 1
            # the answer as a chat app keeps it: the streamed text (C strings: no NUL)
            kept_text = b"".join(piece for piece, t in zip(pieces, fed) if t not in media)
            text = kept_text.decode("utf-8", errors="replace").replace("\x00", "\ufffd")
            messages = messages + [{"role": "assistant", "content": text}]
    (out / "result.json").write_text("{}")


def _module_child(request: dict[str, Any]) -> None:
    import MNN.expr as F
    import MNN.nn as nn

    out = Path(request["out"])
    feeds = Path(request.get("feeds", request["out"]))
    settings = request.get("settings")
    runtime = None
    if settings is not None:
        runtime = nn.create_runtime_manager(({"backend": "CPU", "numThread": int(request["thread_num"]),
                                              "precision": _PRECISION[settings.get("precision", "normal")],
                                              "memory": _MEMORY[settings.get("memory", "normal")]},))
        runtime.set_hint(_DYNAMIC_QUANT_OPTIONS, int(settings.get("dynamic_option", 0)))
    module = nn.load_module_from_file(request["model"], request["inputs"], request["outputs"],
                                      precision_mode=F.PrecisionMode.Normal, memory_mode=F.MemoryMode.Normal,
                                      thread_num=int(request["thread_num"]), runtime_manager=runtime)
    for r in range(int(request["runs"])):
        args = []
        for i in range(len(request["inputs"])):
            value = np.load(feeds / f"in{r}_{i}.npy")
            dtype = F.int if value.dtype.kind in "iu" else F.float
            args.append(F.const(value.astype(np.int32 if dtype == F.int else np.float32), list(value.shape), F.NCHW,
                                dtype))
        results = module.forward(args)
        for i, var in enumerate(results if isinstance(results, (list, tuple)) else [results]):
            np.save(out / f"out{r}_{i}.npy", np.array(F.convert(var, F.NCHW).read(), dtype=np.float32, copy=True))
    (out / "result.json").write_text("{}")


def _batch_child(request: dict[str, Any]) -> None:
    """Each request in turn; one that raises is reported in its folder (``failed.txt``) and the
    next one runs (a crash ends them all)."""
    failed = 0
    for sub in request["requests"]:
        try:
            _MODES[sub.get("mode", "text")](sub)
        except Exception as exc:
            print(f"runtime child failed: {exc!r}", file=sys.stderr)
            (Path(sub["out"]) / "failed.txt").write_text(f"runtime child failed: {exc!r}")
            failed += 1
    if failed:
        raise RuntimeError(f"{failed} of {len(request['requests'])} requests failed")


_MODES: dict[str, Callable[[dict[str, Any]], None]] = {
    "text": _child, "media": _media_child, "module": _module_child, "chat": _chat_child, "score": _score_child,
    "batch": _batch_child}

if __name__ == "__main__":
    try:
        request = json.loads(sys.stdin.read())
        _MODES[request.get("mode", "text")](request)
        code = 0
    except Exception as exc:  # reported through the exit code and stderr to the parent
        print(f"runtime child failed: {exc!r}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
