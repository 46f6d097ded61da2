"""Tiny byte-level BPE tokenizers in the styles of GPT-2, Llama-3, Qwen2.5/3 and LFM2, trained on the fly.

Each style has the structure of the real files (tokenizer.json as the `tokenizers` library
writes them for those models), trained on the small corpus of ``llmexport.tiny.tokenizer``:

* ``gpt2``: ByteLevel pre-tokenizer with its built-in regex, ByteLevel decoder, BPE without
  byte fallback, ``<|endoftext|>`` as bos/eos/unk, also in the model vocabulary;
* ``llama3``: NO normalizer, Split with Llama-3's regex (case-insensitive contractions, digits in
  runs of 1-3) then ByteLevel without regex, ``ignore_merges``, BOS added by a TemplateProcessing
  post-processor, header/eot special tokens, a Llama-3 chat template;
* ``qwen``: NFC normalizer, Split with Qwen2's regex (single digits), ByteLevel without regex,
  ``<|im_start|>``/``<|im_end|>`` chat markers, ``<think>``/``</think>`` as non-special added
  tokens, no BOS, a ChatML template (Qwen2.5 and Qwen3 share this tokenizer layout);
* ``lfm2``: Qwen's text splitting (as the tiny LFM2 checkpoints had before) with LFM2's special
  tokens (``<|pad|>``, ``<|startoftext|>`` as BOS, added in front by a TemplateProcessing
  post-processor, ``<|im_start|>``/``<|im_end|>``, the tool list/call/response markers;
  ``<think>``/``</think>`` non-special), eos ``<|im_end|>`` and LiquidAI's LFM2 chat template
  (``LFM2_CHAT_TEMPLATE``). The released files number these specials 0-13; here they follow the
  model vocabulary as in the other styles.

The 256 byte characters take ids 0-255, learned merges follow, the added tokens come last
(outside the model vocabulary, as in Llama-3 and Qwen). The GPT-2/Llama-3/Qwen chat templates
are written in the subset of Jinja that MNN's runtime (minja) renders the same as transformers;
LFM2's is the real one, which the LFM2 family exports in a runtime form
(llmexport.models.lfm2.chat_template).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from llmexport.source.importers.gguf.tokenizer import LLAMA3_PATTERN, QWEN_PATTERN
from llmexport.tiny.tokenizer import TRAINING_CORPUS

__all__ = ["STYLES", "EXTRA_CORPUS", "TokenizerStyle", "build_byte_level_tokenizer", "write_checkpoint_tokenizer",
           "write_generation_config",
           "LLAMA3_PATTERN", "QWEN_PATTERN"]

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# More text for the byte-level styles: contractions in several cases (the regexes treat them
# specially), digit runs, Cyrillic, Vietnamese, Japanese, Korean, combining marks, emoji sequences.
EXTRA_CORPUS = """\
It's what we'll do: they're here, you've seen it, I'm sure, he'd know. IT'S WE'LL THEY'RE I'M HE'D
it's it's we'll we'll they're they're you've you've I'm I'm he'd he'd don't don't can't can't
Call 555-0123 or 555-0199 before 2024-05-17 at 10:30; order 1234567 costs 89.50 and 12,345.67 units.
Привет, мир! Это небольшой тест токенизатора. Привет, мир! Москва и Санкт-Петербург.
Tiếng Việt có dấu: Việt Nam, Hà Nội, thành phố Hồ Chí Minh. Tiếng Việt rất đẹp.
日本語のテキストです。東京と大阪。ひらがなとカタカナ。日本語のテキストです。
한국어 텍스트입니다. 서울과 부산. 한국어 텍스트입니다.
cafe\u0301 nai\u0308ve re\u0301sume\u0301 — café naïve résumé; Ελληνικά κείμενα, Ελληνικά.
👩‍👩‍👧 👨‍💻 🇩🇪 🇫🇷 👍🏽 ❤️ 👩‍👩‍👧 👨‍💻 🇩🇪 🇫🇷
    four spaces		two tabs
\r\nWindows line\r\nendings\r\n and trailing spaces\x20\x20\x20
"""
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: LiquidAI's LFM2 chat template as released (HF ``LiquidAI/LFM2-8B-A1B``'s ``chat_template.jinja``,
#: vendored by llama.cpp as ``models/templates/LFM2-8B-A1B.jinja``; tests/test_lfm2_chat_template.py
#: checks it against that copy): bos, an optional system message, tools as a JSON list between
#: ``<|tool_list_start|>``/``<|tool_list_end|>``, ChatML turns, tool results between
#: ``<|tool_response_start|>``/``<|tool_response_end|>``
LFM2_CHAT_TEMPLATE = """{{- bos_token -}}
{%- set system_prompt = "" -%}
{%- set ns = namespace(system_prompt="") -%}
{%- if messages[0]["role"] == "system" -%}
\t{%- set ns.system_prompt = messages[0]["content"] -%}
\t{%- set messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
\t{%- set ns.system_prompt = ns.system_prompt + ("\\n" if ns.system_prompt else "") + \
"List of tools: <|tool_list_start|>[" -%}
\t{%- for tool in tools -%}
\t\t{%- if tool is not string -%}
\t\t\t{%- set tool = tool | tojson -%}
\t\t{%- endif -%}
\t\t{%- set ns.system_prompt = ns.system_prompt + tool -%}
\t\t{%- if not loop.last -%}
\t\t\t{%- set ns.system_prompt = ns.system_prompt + ", " -%}
\t\t{%- endif -%}
\t{%- endfor -%}
\t{%- set ns.system_prompt = ns.system_prompt + "]<|tool_list_end|>" -%}
{%- endif -%}
{%- if ns.system_prompt -%}
\t{{- "<|im_start|>system\\n" + ns.system_prompt + "<|im_end|>\\n" -}}
{%- endif -%}
{%- for message in messages -%}
\t{{- "<|im_start|>" + message["role"] + "\\n" -}}
\t{%- set content = message["content"] -%}
\t{%- if content is not string -%}
\t\t{%- set content = content | tojson -%}
\t{%- endif -%}
\t{%- if message["role"] == "tool" -%}
\t\t{%- set content = "<|tool_response_start|>" + content + "<|tool_response_end|>" -%}
\t{%- endif -%}
\t{{- content + "<|im_end|>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
\t{{- "<|im_start|>assistant\\n" -}}
{%- endif -%}"""


@dataclass(frozen=True)
class TokenizerStyle:
    name: str
    specials: tuple[str, ...]  # added special tokens, in id order after the model vocabulary
    plain_added: tuple[str, ...]  # added tokens that are not special
    bos: str | None
    eos: str
    pad: str | None
    end_of_turn: str  # the chat template's turn end (generation_config eos beside eos)
    generation_eos: tuple[str, ...]
    chat_template: str | None
    #: the text splitting (normalizer, pre-tokenizer) of this style: "gpt2", "llama3" or "qwen"
    splitting: str = ""
    #: a TemplateProcessing post-processor puts ``bos`` in front (``add_bos_token``)
    adds_bos: bool = False

    @property
    def text(self) -> str:
        return self.splitting or self.name


STYLES: dict[str, TokenizerStyle] = {
    "gpt2": TokenizerStyle("gpt2", ("<|endoftext|>",), (), "<|endoftext|>", "<|endoftext|>", None, "<|endoftext|>",
                           ("<|endoftext|>",), None),
    "llama3": TokenizerStyle(
        "llama3", ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                   "<|eot_id|>", "<|python_tag|>"), (),
        "<|begin_of_text|>", "<|eot_id|>", None, "<|eot_id|>", ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        LLAMA3_CHAT_TEMPLATE, adds_bos=True),
    "qwen": TokenizerStyle(
        "qwen", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>"), ("<think>", "</think>"),
        None, "<|im_end|>", "<|endoftext|>", "<|im_end|>", ("<|im_end|>", "<|endoftext|>"), CHATML_TEMPLATE),
    "lfm2": TokenizerStyle(
        "lfm2", ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
                 "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                 "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>"), ("<think>", "</think>"),
        "<|startoftext|>", "<|im_end|>", "<|pad|>", "<|im_end|>", ("<|im_end|>",), LFM2_CHAT_TEMPLATE,
        splitting="qwen", adds_bos=True),
}


def _pre_tokenizer(style: str):
    if style == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pattern = LLAMA3_PATTERN if style == "llama3" else QWEN_PATTERN
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=style == "llama3", use_regex=False),
    ])


def _train(style: str, budget: int, corpus: str | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte alphabet (ids 0-255, in byte order) plus merges learned on the corpus (``corpus``:
    another text, paragraphs separated by empty lines)."""
    from llmexport.mnn.tokenizer.byte_level import byte_level_chars

    trainer_tok = Tokenizer(BPE())
    if style == "qwen":
        trainer_tok.normalizer = normalizers.NFC()
    trainer_tok.pre_tokenizer = _pre_tokenizer(style)
    trainer = BpeTrainer(vocab_size=budget, min_frequency=2, show_progress=False, special_tokens=[],
                         initial_alphabet=byte_level_chars())
    trainer_tok.train_from_iterator((corpus or TRAINING_CORPUS + EXTRA_CORPUS).split("\n\n"), trainer=trainer)
    data = json.loads(trainer_tok.to_str())
    vocab = {c: b for b, c in enumerate(byte_level_chars())}
    for piece, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in data["model"]["merges"]]
    return vocab, merges


def _build(style: TokenizerStyle, vocab_size: int, corpus: str | None = None) -> Tokenizer:
    added = style.specials + style.plain_added
    vocab, merges = _train(style.text, vocab_size - len(added), corpus)
    if style.name == "gpt2":  # GPT-2 keeps <|endoftext|> in the model vocabulary (its last id)
        vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=style.name == "llama3"))
    if style.text == "qwen":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(style.text)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in style.specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in style.plain_added])
    if style.bos and style.adds_bos:
        bos_id = tok.token_to_id(style.bos)
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{style.bos}:0 $A:0", pair=f"{style.bos}:0 $A:0 {style.bos}:1 $B:1",
                                          special_tokens=[(style.bos, bos_id)])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_byte_level_tokenizer(out_dir: Path, style: str, vocab_size: int = 512,
                               corpus: str | None = None) -> TokenizerStyle:
    """Train a tokenizer of ``style`` (see ``STYLES``) with at most ``vocab_size`` ids and write
    ``tokenizer.json``, ``tokenizer_config.json`` (and ``chat_template.jinja``) into ``out_dir``.
    ``generation_config.json`` is the model's, not written here (``STYLES[style].generation_eos``).
    ``corpus``: the text to learn the merges on (default: the small embedded one)."""
    if style not in STYLES:
        raise ValueError(f"unknown tokenizer style {style!r}; choose from {sorted(STYLES)}")
    spec = STYLES[style]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _build(spec, vocab_size, corpus)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec.bos, "eos_token": spec.eos,
        "pad_token": spec.pad, "add_bos_token": spec.adds_bos, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072,
    }
    if spec.name == "gpt2":
        config["unk_token"] = spec.eos
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if spec.chat_template:
        (out_dir / "chat_template.jinja").write_text(spec.chat_template, encoding="utf-8")
    return spec


def write_checkpoint_tokenizer(out_dir: Path, style: str, vocab_size: int,
                               corpus: str | None = None) -> dict[str, int | list[int] | None]:
    """A checkpoint's tokenizer files of ``style``; returns the token ids its config.json and
    generation_config.json carry (bos/eos/pad_token_id; eos: the style's generation eos ids)."""
    spec = build_byte_level_tokenizer(out_dir, style, vocab_size, corpus)
    tok = Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))
    eos = [tok.token_to_id(t) for t in spec.generation_eos]
    if None in eos:
        raise ValueError(f"{style}: a generation eos token of {spec.generation_eos} is not in the vocabulary")
    return {"bos_token_id": tok.token_to_id(spec.bos) if spec.bos else None,
            "eos_token_id": [i for i in eos if i is not None],
            "pad_token_id": tok.token_to_id(spec.pad) if spec.pad else None}


def write_generation_config(out_dir: Path, token_ids: dict[str, int | list[int] | None]) -> None:
    """generation_config.json with greedy decoding and ``token_ids`` (after ``save_pretrained``,
    which writes its own)."""
    (Path(out_dir) / "generation_config.json").write_text(json.dumps(dict(token_ids, do_sample=False), indent=2),
                                                          encoding="utf-8")
