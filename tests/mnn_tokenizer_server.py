"""Test utility: MNN 3.6.1's tokenizer in a long-lived child process, asked one request at a time.

The child loads a dummy model (tests/mnn_dummy.py) beside the tokenizer file and answers JSON
lines on a pipe of its own (the runtime prints to stdout), so a property test can send
thousands of strings without starting a runtime per string.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
out = os.fdopen({fd}, "w", encoding="utf-8")
from mnn_dummy import write_dummy_mnn_model
import MNN.llm as L
cfg = write_dummy_mnn_model({folder!r}, {tokenizer!r}, {vocab}, jinja={jinja!r})
m = L.create(str(cfg))
m.load()

def decode(i):
    try:
        return m.tokenizer_decode(i)
    except UnicodeDecodeError:
        return None

for line in sys.stdin:
    req = json.loads(line)
    if "encode" in req:
        res = [m.tokenizer_encode(t) for t in req["encode"]]
    elif "decode" in req:
        res = [decode(i) for i in req["decode"]]
    elif "render" in req:  # one template and context, set with set_config (which merges)
        r = req["render"]
        jinja = {{"context": r["context"]}}
        if r.get("template") is not None:
            jinja["chat_template"] = r["template"]
        m.set_config({{"jinja": jinja}})
        res = m.apply_chat_template(r["messages"])
    else:
        res = {{name: m.apply_chat_template(msgs) for name, msgs in req["chat"].items()}}
    out.write(json.dumps(res, ensure_ascii=False) + "\\n")
    out.flush()
os._exit(0)
"""


class MnnTokenizer:
    """``encode(texts)``, ``decode(ids)`` and ``chat(named message lists)`` answered by the runtime
    reading ``folder/tokenizer_file``; ``jinja`` goes into the dummy model's llm_config.json."""

    def __init__(self, folder: Path, tokenizer_file: str, vocab_size: int, jinja: dict | None = None):
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._log = Path(folder) / "child.log"
        read_fd, write_fd = os.pipe()
        script = _CHILD.format(tests=str(Path(__file__).resolve().parent), fd=write_fd, folder=str(folder),
                               tokenizer=tokenizer_file, vocab=vocab_size, jinja=jinja)
        self._proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=self._log.open("w"), pass_fds=(write_fd,),
                                      text=True, encoding="utf-8", env=dict(os.environ, HF_HUB_OFFLINE="1"))
        os.close(write_fd)
        self._answers = os.fdopen(read_fd, "r", encoding="utf-8")

    def _ask(self, request: dict):
        self._proc.stdin.write(json.dumps(request, ensure_ascii=False) + "\n")
        self._proc.stdin.flush()
        line = self._answers.readline()
        if not line:
            raise RuntimeError(f"MNN tokenizer child died (rc={self._proc.wait()}): {self._log.read_text()[-4000:]}")
        return json.loads(line)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self._ask({"encode": list(texts)})

    def decode(self, ids: list[int]) -> list[str | None]:
        """Single-id decodes (``Llm::tokenizer_decode``); None where the bytes are not valid UTF-8."""
        return self._ask({"decode": list(ids)})

    def chat(self, chats: dict[str, list[dict]]) -> dict[str, str]:
        return self._ask({"chat": chats})

    def render(self, template: str | None, messages: list[dict], context: dict) -> str:
        """``apply_chat_template(messages)`` after ``set_config`` of ``template`` (None: keep the
        current one) and ``jinja.context``; the runtime merges config, so earlier keys stay."""
        return self._ask({"render": {"template": template, "messages": messages, "context": context}})

    def close(self) -> None:
        self._proc.stdin.close()
        self._answers.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()


@dataclass
class ChatTemplateRig:
    """What a chat-template test module renders with: a tokenizer folder (``folder``, with the
    runtime's ``tokenizer.mtok``), transformers' tokenizer of it (``hf``) and the runtime's
    renderer in a child process (``runtime``, ``MnnTokenizer``)."""

    folder: Path
    hf: Any
    runtime: MnnTokenizer

    def close(self) -> None:
        self.runtime.close()


def chat_template_rig(folder: Path, build_tokenizer: Callable[[Path], Any], eos: str,
                      end_of_turn: tuple[str, ...] = ()) -> ChatTemplateRig:
    """Build the tokenizer into ``folder`` (``build_tokenizer(folder)``), write its runtime file
    and start the runtime's renderer; its jinja context carries ``eos``."""
    from transformers import AutoTokenizer

    from llmexport.mnn.tokenizer.writer import write_mnn_tokenizer

    build_tokenizer(folder)
    write_mnn_tokenizer(folder, folder / "tokenizer.mtok", end_of_turn=end_of_turn)
    hf = AutoTokenizer.from_pretrained(folder)
    runtime = MnnTokenizer(folder / "runtime", "../tokenizer.mtok", len(hf), jinja={"chat_template": "", "eos": eos})
    return ChatTemplateRig(folder, hf, runtime)


# --- chat messages, as the chat-template tests' corpora write them -----------------------------------

def user_message(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant_message(text: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **extra}


def tool_message(text: Any) -> dict[str, Any]:
    return {"role": "tool", "content": text}
