"""The media conversation: a chat whose first user turn carries a tower's medium, then text turns,
through MNN's runtime chat path against HF's full model carrying the stored weights.

The runtime side is the conversation check's (llmexport/verification/conversation.py): one
runtime instance keeping its KV cache across turns (mnn/runtime.py ``run_chat``), here on MNN's
exact kernels like the media prompts (llmexport/verification/media.py), whatever profile ships.
The first user message is the medium's runtime tag from the tower's last media prompt
(``PromptCase.runtime_text``: ``<img>...</img>`` or ``<audio>...</audio>``) followed by that
prompt's ``question``, so the first turn's ids are the prompt's; the later turns are
``USER_TURNS[0][1:]``.

HF's side is the same for every tower family: ``TowerCheck.prompt_logits`` on the prompt's
processor outputs, for the ids of each turn (the prompt's ids extended by the later turns,
teacher-forced on the runtime's answer), so the medium's features, HF's positions (M-RoPE over
the whole history), token types and attention spans are HF's own in every turn. HF's ids of each
turn are the checkpoint's chat template on the history with the medium as HF's processor expands
it (the prompt's span of media tokens, decoded), compared with the runtime's. A turn whose ids do
not extend the prompt's ends the check there (HF has no inputs for another layout).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from torch import nn

from llmexport.mnn.config import EXACT_KERNELS
from llmexport.mnn.runtime import ChatRun, common_prefix_length, run_chat
from llmexport.mnn.tokenizer.stream import StreamModel
from llmexport.models.base import Architecture
from llmexport.models.tower_check import PromptCase, TowerCheck
from llmexport.results import ConversationCheck, TowerReport
from llmexport.verification.conversation import (
    ANSWER_STEPS,
    USER_TURNS,
    Conversations,
    conversation_failures,
    conversation_summary,
    reference_stop_ids,
)

#: a medium in a runtime prompt (omni.cpp's tags)
MEDIA_TAG = re.compile(r"<(img|audio)>.*?</\1>", re.S)
#: the text turns after the medium's turn
FOLLOW_UPS = USER_TURNS[0][1:]


def media_conversation(export_dir: Path, arch: Architecture, check: TowerCheck, oracle: nn.Module,
                       fp32: nn.Module) -> ConversationCheck | str:
    """The conversation on the tower's last media prompt's medium (``oracle``: HF carrying the
    stored weights; ``fp32``: HF as the checkpoint holds it), or "skipped: why"."""
    from transformers import AutoTokenizer

    prompt = check.prompts[-1] if check.prompts else None
    if prompt is None or not prompt.question:
        return "skipped: the tower's check has no media prompt with a question to open a chat with"
    with tempfile.TemporaryDirectory(prefix="llmexport-media-chat-") as tmp:
        tag = MEDIA_TAG.search(prompt.runtime_text(Path(tmp)))
        if tag is None:
            return f"skipped: {prompt.name}'s runtime text has no <img> or <audio> tag"
        users = [[tag.group(0) + prompt.question, *FOLLOW_UPS]]
        run = run_chat(export_dir, users, ANSWER_STEPS, config=EXACT_KERNELS)
    tokenizer = AutoTokenizer.from_pretrained(arch.checkpoint.path, trust_remote_code=False)
    chat = Conversations.of(export_dir, users, 0, extending(run, prompt))
    chat.forward = lambda model: check.prompt_logits(model, prompt)
    chat.media = (tag.group(0), hf_media_text(tokenizer, prompt, check.stop_ids))
    chat.add_oracle(arch, oracle, reference_stop_ids(arch.checkpoint.path, tokenizer, arch) | check.stop_ids)
    chat.add_fp32(arch, fp32)
    return chat.check(tokenizer, StreamModel.from_folder(arch.checkpoint.path))


def extending(run: ChatRun, prompt: PromptCase) -> ChatRun:
    """``run``'s turns while their ids extend the prompt's (HF's inputs exist only for those); the
    first that does not ends it, with the reason as its error."""
    for i, turn in enumerate(run.turns):
        if turn.ids[:len(prompt.ids)] != prompt.ids:
            at = common_prefix_length(turn.ids, prompt.ids)
            return ChatRun(run.turns[:i], f"the runtime's ids differ from {prompt.name}'s (HF's processor) at token "
                                          f"{at} of {len(prompt.ids)}")
    return run


def hf_media_text(tokenizer, prompt: PromptCase, media_ids: frozenset[int]) -> str:
    """HF's text for the prompt's medium as HF's processor expanded its placeholder: the ids from
    the first to the last media token, widened over the added tokens next to them (the medium's
    begin and end marks, e.g. Gemma4's ``<|image>`` and ``<image|>``), decoded with their special
    tokens."""
    ids, added = prompt.ids, set(tokenizer.added_tokens_decoder)
    at = [i for i, token in enumerate(ids) if token in media_ids]
    if not at:
        raise ValueError(f"{prompt.name}: no media token in HF's ids")
    first, last = at[0], at[-1]
    while first > 0 and ids[first - 1] in added:
        first -= 1
    while last + 1 < len(ids) and ids[last + 1] in added:
        last += 1
    return str(tokenizer.decode(ids[first:last + 1], skip_special_tokens=False))


def media_conversation_failures(chat: ConversationCheck | str | None, max_abs: float) -> list[str]:
    """The conversation rules (``conversation_failures``), each failure named as the media
    conversation's, the logits bounded by ``max_abs`` (the exact kernels' bound)."""
    if not isinstance(chat, ConversationCheck):
        return []
    return [f"media conversation: {f}" for f in conversation_failures(chat, max_abs, None, None)]


def media_conversation_summary(name: str, tower: TowerReport) -> str:
    """The tower's media conversation for the verification summary line ("" when not run)."""
    chat = tower.conversation
    if chat is None:
        return ""
    if isinstance(chat, str):
        return f"; {name} media conversation {chat}"
    return f"; {name} media {conversation_summary(chat)}"
