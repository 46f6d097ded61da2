"""A conversation with an exported folder in MNN's LLM runtime (``MNN.llm``), run in a child process.

The runtime holds the conversation in its KV cache; each turn renders the whole conversation with
the runtime's chat template (``apply_chat_template``), encodes only what the cache lacks with the
runtime's tokenizer (which also runs the vision/audio towers on ``<img>``/``<audio>`` tags),
prefills it with ``forward`` and decodes greedily, one ``forward`` per token, streaming each token's
bytes as ``tokenizer_decode`` gives them. This follows the runtime's own prompt cache
(``Llm::response(ChatMessages)``, llm.cpp), which the Python binding cannot reach: its ``response``
takes one string and writes the stream to the C++ ``std::cout`` between debug lines.

Why not ``response``/``generate`` plus ``get_context()`` for the text and timings: the binding
builds the context dict with ``PyDict_SetItemString(dict, "generate_str", string2Object(...))``
(pymnn/src/llm.h, ``PyMNNLLM_get_context``), and ``string2Object`` is ``PyUnicode_FromString``
(pymnn/src/util.h), which returns NULL for bytes that are not UTF-8; the NULL goes into the dict
and the process dies with SIGSEGV. ``generate_str`` is the concatenation of every generated
token's bytes (``ArGeneration::generate``), so an answer that ends inside a multi-byte character
or holds a stray byte piece -- frequent with random weights, possible with real ones when
``max_new_tokens`` cuts a character -- crashes it. This module never calls ``get_context``
(``MNN.llm.create`` calls it once, before anything is generated, when its strings are empty) and
times the calls itself.

The child ends with ``os._exit`` (the runtime can crash at interpreter exit, see runtime.py), keeps
the C library's stdout (MNN's log lines) out of the protocol, and ignores SIGINT: the parent owns
the terminal and kills the child when it stops.
"""

from __future__ import annotations

import codecs
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Callable

from llmexport.errors import ConversionError, InputError, UsageError
from llmexport.mnn.arm.machine import HOST
from llmexport.mnn.config import cache_can_be_cut
from llmexport.mnn.export_check import MEDIA_TAG, RunnableExport
from llmexport.mnn.runtime import common_prefix_length


@dataclass(frozen=True)
class TurnStats:
    prompt_tokens: int  # tokens prefilled in this turn (what the KV cache lacked)
    context_tokens: int  # tokens in the KV cache after the answer
    encode_s: float  # template, tokenizer and media towers
    prefill_s: float
    decode_tokens: int  # forward calls after the prefill
    decode_s: float

    def summary(self, context: int | None) -> str:
        def rate(tokens: int, seconds: float) -> str:
            return f"{tokens / seconds:.1f} tok/s" if tokens and seconds > 0 else "- tok/s"

        limit = f"/{context}" if context else ""
        return (f"prefill {self.prompt_tokens} tok, {rate(self.prompt_tokens, self.prefill_s)} | "
                f"decode {self.decode_tokens} tok, {rate(self.decode_tokens, self.decode_s)} | "
                f"context {self.context_tokens}{limit}")


@dataclass(frozen=True)
class TurnResult:
    text: str  # the answer's bytes decoded as UTF-8 (invalid bytes as U+FFFD)
    ids: list[int]  # generated ids, the stop id excluded
    stop: str  # "eos" (a stop id), "length" (max_new_tokens), "context" (the context is full)
    stats: TurnStats
    context_ids: list[int] = field(default_factory=list)  # the KV cache's ids when the answer began

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ChatSession:
    """One runtime instance in a child process. ``ask`` streams an answer; ``reset`` empties the
    conversation (the runtime's ``reset``); ``close`` (or leaving the ``with`` block) ends it."""

    def __init__(self, export: RunnableExport, *, system: str | None = None, template: bool = True,
                 thread_num: int | None = None):
        self.export = export
        request = {"config": str(export.config_path), "system": system, "template": template,
                   "context": export.context, "multimodal": export.visual or export.audio,
                   "set_config": {"thread_num": thread_num} if thread_num else {}}
        self._log = tempfile.TemporaryFile(prefix="llmexport-run-")
        self._proc = subprocess.Popen(HOST.command("llmexport.mnn.chat"), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=HOST.environment(), text=True,
                                      encoding="utf-8")
        self.load_s = 0.0
        try:
            self._send(request)
            ready = self._receive("loading the export")
            if "ready" not in ready:
                raise self._error(ready.get("error", {}), "loading the export")
            self.load_s = float(ready["ready"]["load_s"])
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self, text: str, max_new_tokens: int, on_text: Callable[[str], None] | None = None) -> TurnResult:
        """One user message -> the answer, each decoded piece passed to ``on_text`` as it arrives.
        UsageError (the session stays usable) when the turn does not fit the context, the template
        renders nothing or media ids cannot be placed; ConversionError when the runtime fails."""
        self._send({"op": "ask", "text": text, "max_new_tokens": int(max_new_tokens)})
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            event = self._receive("answering")
            if "token" in event:
                piece = decoder.decode(bytes.fromhex(event["bytes"]))
                if piece and on_text:
                    on_text(piece)
            elif "done" in event:
                piece = decoder.decode(b"", final=True)
                if piece and on_text:
                    on_text(piece)
                done = event["done"]
                return TurnResult(done["text"], done["ids"], done["stop"], TurnStats(**done["stats"]),
                                  done["context_ids"])
            else:
                raise self._error(event.get("error", {}), "answering")

    def reset(self) -> None:
        self._send({"op": "reset"})
        event = self._receive("resetting")
        if "reset" not in event:
            raise self._error(event.get("error", {}), "resetting")

    def close(self) -> None:
        proc = self._proc
        if proc.poll() is None:
            try:
                if proc.stdin:
                    proc.stdin.close()  # the child exits at the end of its input
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream:
                    stream.close()
            except OSError:
                pass
        self._log.close()

    def kill(self) -> None:
        """Stop at once (Ctrl-C during an answer, a failed start)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self.close()

    def _send(self, message: dict[str, Any]) -> None:
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died("receiving a request") from None

    def _receive(self, phase: str) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise self._died(phase)
        return json.loads(line)

    def _died(self, phase: str) -> ConversionError:
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        last = self._log_tail()
        return ConversionError(f"MNN's runtime {how} while {phase} ({self.export.folder})"
                               + (f"; its last log line: {last}" if last else ""))

    def _error(self, error: dict[str, Any], phase: str) -> Exception:
        message = str(error.get("message", "unknown error"))
        if error.get("kind") in ("context", "template", "media", "prefill"):
            return UsageError(message)
        if error.get("kind") == "load":  # the files passed export_check, yet the runtime refuses them
            last = self._log_tail()
            return InputError(f"{self.export.folder}: MNN's runtime cannot load this export"
                              + (f" (its last log line: {last})" if last else ""))
        return ConversionError(f"MNN's runtime failed while {phase} ({self.export.folder}): {message}")

    def _log_tail(self) -> str:
        try:
            self._log.seek(0)
            lines = [line.strip() for line in self._log.read().decode("utf-8", "replace").splitlines()]
        except (OSError, ValueError):
            return ""
        lines = [line for line in lines if line and not line.startswith("The device supports")]
        return lines[-1][:300] if lines else ""


# --- the child: owns the runtime instance ------------------------------------------------------


class _TurnError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _Conversation:
    """The runtime instance, the conversation (messages) and the ids its KV cache holds."""

    def __init__(self, request: dict[str, Any], out: IO[str]):
        import MNN.llm as llm

        self.out = out
        started = time.perf_counter()
        self.llm = llm.create(request["config"])._c_obj  # create() reads the context once, while it is empty
        if request["set_config"]:
            self.llm.set_config(json.dumps(request["set_config"]))
        if not self.llm.load():
            raise _TurnError("load", "the runtime could not load the model")
        self.load_s = time.perf_counter() - started
        self.template, self.context = bool(request["template"]), request["context"]
        self.multimodal = bool(request["multimodal"])
        self.system = request["system"]
        config = json.loads(self.llm.dump_config())
        self.pads = {config[key] for key in ("image_pad", "audio_pad") if isinstance(config.get(key), int)}
        self.cut = cache_can_be_cut(config)  # False: recurrent state, never erase to a shorter history
        a, b = self._encode("a"), self._encode("b")
        self.prefix = a[:common_prefix_length(a, b)]  # ids the tokenizer puts in front of every encode
        self.clear()

    def clear(self) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self.rendered = ""  # the template's text for the conversation up to the last answer's start
        self.kv: list[int] = []  # ids in the runtime's KV cache
        self.answer: list[int] = []  # the last answer's ids (in self.kv)
        self.answer_text = ""

    def reset(self) -> None:
        self.llm.reset()
        self.clear()

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.llm.tokenizer_encode(text)]

    def _strip(self, ids: list[int]) -> list[int]:
        return ids[len(self.prefix):] if self.prefix and ids[:len(self.prefix)] == self.prefix else ids

    def _token_bytes(self, token: int) -> bytes:
        try:
            return self.llm.tokenizer_decode(token).encode("utf-8")
        except UnicodeDecodeError as exc:  # a byte piece: the binding fails to make a str of it
            return bytes(exc.object)

    def _is_stop(self, token: int) -> bool:
        """The runtime's own stop list (``Llm::is_stop``), reached through ``stoped()``."""
        self.llm.set_context({"current_token": token})
        return bool(self.llm.stoped())

    def _plan(self, text: str) -> tuple[list[int], str, int, Any]:
        """(ids the KV cache must hold before the answer, the text encoded for them, how many of the
        cached ids stay, the conversation to commit)."""
        if not self.template:
            encoded = self._encode(text)
            target = self.kv + (self._strip(encoded) if self.kv else encoded)
            return target, text, len(self.kv), None
        messages = self.messages + [{"role": "user", "content": text}]
        full = self.llm.apply_chat_template(messages)
        if not full:
            raise _TurnError("template", "the chat template rendered an empty prompt (try --raw)")
        if self.rendered and full.startswith(self.rendered):
            delta = full[len(self.rendered):]
            if delta.startswith(self.answer_text):  # the usual case: keep the answer's own ids
                tail = delta[len(self.answer_text):]
                return self.kv + self._strip(self._encode(tail)), tail, len(self.kv), (messages, full)
            base = len(self.kv) - len(self.answer)  # the template rewrote the answer: re-encode it
            target = self.kv[:base] + self._strip(self._encode(delta))
            return target, delta, common_prefix_length(self.kv, target), (messages, full)
        target = self._encode(full)  # first turn, or a template whose earlier turns change
        keep = 0 if self.multimodal and MEDIA_TAG.search(full) else common_prefix_length(self.kv, target)
        return target, full, keep, (messages, full)

    def _check_media_runs(self, feed: list[int], encoded_text: str) -> None:
        """Omni::embedding gives the i-th run of pad ids the i-th media embedding the last encode
        made; a run without one (a pad id in an answer) would read past that list."""
        if not self.multimodal or not self.pads:
            return
        runs = sum(1 for i, t in enumerate(feed) if t in self.pads and (i == 0 or feed[i - 1] != t))
        if runs > len(MEDIA_TAG.findall(encoded_text)):
            raise _TurnError("media", "the conversation holds image/audio placeholder ids without their media "
                                      "(did an answer produce them?); /reset to start over")

    def ask(self, text: str, max_new_tokens: int) -> dict[str, Any]:
        started = time.perf_counter()
        target, encoded_text, keep, commit = self._plan(text)
        if self.context and len(target) > self.context:
            raise _TurnError("context", f"the conversation needs {len(target)} tokens, more than the export's "
                                        f"context of {self.context} (max_position_embeddings); /reset or shorten it")
        keep = min(keep, len(target) - 1)  # at least one id to prefill: its logits start the answer
        if keep < len(self.kv) and not self.cut:
            keep = 0  # a recurrent state cannot be cut back: reset and prefill the whole history
        feed = target[keep:]
        self._check_media_runs(feed, encoded_text)
        if keep == 0 and not self.cut and len(feed) < 2:
            # the op zeroes its state only on a multi-token call of a fresh sequence
            raise _TurnError("prefill", "this export carries recurrent state that a one-token start would not "
                                        "clear; say more, or start with a template (no --raw)")
        if keep == 0 and self.kv:
            self.llm.reset()
        elif keep < len(self.kv):
            self.llm.erase_history(keep, 0)
        self.llm.set_context({"gen_seq_len": 0})  # a prefill, as generate_init marks it: the prefill module
        encoded = time.perf_counter()
        token = _argmax(self.llm.forward(feed))
        prefilled = time.perf_counter()
        self.kv = list(target)
        if commit is not None:
            self.messages, self.rendered = commit
        ids, pieces, stop, steps = self._decode(token, max_new_tokens)
        finished = time.perf_counter()
        self.answer = ids[:len(ids) - (stop == "context")]
        self.answer_text = b"".join(pieces).decode("utf-8", "replace")
        if self.template:
            self.messages = self.messages + [{"role": "assistant", "content": self.answer_text}]
        stats = TurnStats(len(feed), len(self.kv), encoded - started, prefilled - encoded, steps,
                          finished - prefilled)
        return {"text": self.answer_text, "ids": ids, "stop": stop, "stats": asdict(stats), "context_ids": target}

    def _decode(self, token: int, max_new_tokens: int) -> tuple[list[int], list[bytes], str, int]:
        ids: list[int] = []
        pieces: list[bytes] = []
        steps = 0
        while len(ids) < max_new_tokens:
            if self._is_stop(token):
                return ids, pieces, "eos", steps
            ids.append(token)
            pieces.append(self._token_bytes(token))
            _emit(self.out, {"token": token, "bytes": pieces[-1].hex()})
            if self.context and len(self.kv) >= self.context:
                return ids, pieces, "context", steps
            # every answer id goes into the cache, the last one too (as ArGeneration does)
            logits = self.llm.forward([token])
            self.kv.append(token)
            steps += 1
            token = _argmax(logits)
        return ids, pieces, "length", steps


def _argmax(logits: Any) -> int:
    import numpy as np

    # read() can alias the runtime's output buffer: argmax is taken before the next forward
    return int(np.argmax(np.asarray(logits.read(), dtype=np.float32).reshape(-1)))


def _emit(out: IO[str], event: dict[str, Any]) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()


def _serve(out: IO[str]) -> int:
    request = json.loads(sys.stdin.readline())
    try:
        conversation = _Conversation(request, out)
    except _TurnError as exc:
        _emit(out, {"error": {"kind": exc.kind, "message": str(exc)}})
        return 1
    except Exception as exc:
        _emit(out, {"error": {"kind": "runtime", "message": f"{type(exc).__name__}: {exc}"}})
        return 1
    _emit(out, {"ready": {"load_s": conversation.load_s}})
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if message["op"] == "reset":
                conversation.reset()
                _emit(out, {"reset": True})
            elif message["op"] == "ask":
                _emit(out, {"done": conversation.ask(message["text"], int(message["max_new_tokens"]))})
        except _TurnError as exc:
            _emit(out, {"error": {"kind": exc.kind, "message": str(exc)}})
        except Exception as exc:  # reported to the parent, which maps it to a one-line error
            _emit(out, {"error": {"kind": "runtime", "message": f"{type(exc).__name__}: {exc}"}})
            return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # MNN prints to the C stdout: keep that in the log, out of the protocol
    try:
        status = _serve(protocol)
    except BrokenPipeError:
        status = 1
    except Exception as exc:
        print(f"chat child failed: {exc!r}", file=sys.stderr)
        status = 1
    sys.stderr.flush()
    os._exit(status)
