"""A tiny Gemma4-style tokenizer, trained on the fly for tests.

The tokenizer mirrors the structure of the real Gemma tokenizers as transformers 5 builds them
(`GemmaTokenizer`): a BPE model with byte fallback, a normalizer that turns every space into
"▁" (no prefix space is added), a pre-tokenizer that splits on a literal space (a no-op after
that normalizer, kept because the real files carry it), a decoder that maps "▁" back to a space,
resolves `<0xNN>` byte pieces and fuses the pieces, and a post-processor that prepends `<bos>`.

Training uses the `tokenizers` BPE trainer on a small embedded multilingual corpus, so the
result is identical from run to run; the special tokens and the 256 byte pieces sit at fixed
ids in front of the learned vocabulary (see `SPECIAL_TOKENS`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

__all__ = [
    "SPECIAL_TOKENS",
    "BYTE_TOKEN_OFFSET",
    "GEMMA4_CHAT_TEMPLATE",
    "TRAINING_CORPUS",
    "build_tiny_gemma_tokenizer",
    "LLAMA2_SPECIAL_TOKENS",
    "PHI3_ADDED_TOKENS",
    "build_tiny_sentencepiece_tokenizer",
]

# name -> (token text, id). Ids are fixed; the byte pieces follow right after them.
SPECIAL_TOKENS: dict[str, tuple[str, int]] = {
    "pad": ("<pad>", 0),
    "eos": ("<eos>", 1),
    "bos": ("<bos>", 2),
    "unk": ("<unk>", 3),
    "mask": ("<mask>", 4),
    "start_of_turn": ("<|turn>", 5),
    "end_of_turn": ("<turn|>", 6),
    "boi": ("<|image>", 7),
    "eoi": ("<image|>", 8),
    "image": ("<|image|>", 9),
    "boa": ("<|audio>", 10),
    "eoa": ("<audio|>", 11),
    "audio": ("<|audio|>", 12),
    # The Gemma4 processor registers "<|video|>" itself when it is missing; giving it a fixed id
    # keeps the vocabulary size stable.
    "video": ("<|video|>", 13),
}

BYTE_TOKEN_OFFSET = len(SPECIAL_TOKENS)  # id of "<0x00>"; "<0xFF>" is BYTE_TOKEN_OFFSET + 255
_FIRST_LEARNED_ID = BYTE_TOKEN_OFFSET + 256

_SPACE_PIECE = "\u2581"  # "▁"

# Chat template in Gemma4's turn format, for transformers (full Jinja2). Accepts string content or
# a list of typed parts ({"type": "text", "text": ...}); the role "assistant" is written "model".
GEMMA4_CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}\n"
    "    {{- '<|turn>' + role + '\\n' -}}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{- message['content'] -}}\n"
    "    {%- else -%}\n"
    "        {%- for part in message['content'] -%}\n"
    "            {%- if part['type'] == 'text' -%}{{- part['text'] -}}\n"
    "            {%- elif part['type'] == 'image' -%}{{- '<|image|>' -}}\n"
    "            {%- elif part['type'] == 'audio' -%}{{- '<|audio|>' -}}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- endif -%}\n"
    "    {{- '<turn|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}\n"
)

# Small multilingual training text: English, German with umlauts, Chinese, emoji, digits, code
# and runs of spaces, tabs and newlines. Characters outside it are encoded with byte pieces.
TRAINING_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away!
Hello, world. How are you today? I am fine, thank you. What is the weather like?
A model reads tokens, and the tokenizer turns text into tokens and back into text.
Export the model, then run the model on the phone: it should answer the question.
There are 3 apples, 12 oranges and 1024 bytes in 2 kilobytes; 3.14159 is close to pi.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 512 2048 65536 1e-6 -7 +8 50% $19.99 #1
Über die Brücke gehen wir schön langsam. Grüße aus München! Das Mädchen läuft schnell.
Die Straße ist nass, weil es heute regnet. Ärger, Öl und Übung schreibt man groß.
Größe, Höhe und Weiß: ä ö ü Ä Ö Ü ß. Fünf Bären aßen süße Äpfel.
我们今天去公园散步。你好，世界！这是一个小的测试模型，用来检查分词器。
中文文本和英文文本混合在一起：模型 model 分词 token 测试 test。
人工智能正在改变世界，手机上也可以运行大模型。谢谢你的帮助！
Emoji: 😀 😂 👍 🎉 ❤️ 🚀 🌍 🐍 — smileys and rockets 😀😀 🎉🎉
def add(a, b):
    return a + b

for i in range(10):
\tif i % 2 == 0:
\t\tprint(f"{i} is even")
x = {"key": [1, 2, 3], 'other': None}  # comment
if (x != y && z >= 0) { return -1; } else { y += 2; }
    indented   text   with     multiple      spaces
\t\ttabs\tand\ttext
line one
line two

paragraph after an empty line
user: hi there
model: hello, how can I help you today?
"""


def _train_merges(budget: int, words: bool = False,
                  corpus: str | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """Learn an alphabet plus merges on the corpus, at most `budget` pieces in total.

    The whole alphabet of the corpus is kept (limiting it makes the trainer break ties between
    equally frequent characters in hash order, which is not reproducible). `words`: learn on
    "▁word" units, as SentencePiece does, instead of on whole lines. `corpus`: another text to
    learn on (paragraphs separated by empty lines; default the embedded corpus).
    """
    trainer_tok = Tokenizer(BPE())
    if words:
        trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE_PIECE, prepend_scheme="always")
    else:
        trainer_tok.normalizer = normalizers.Replace(" ", _SPACE_PIECE)
    trainer = BpeTrainer(
        vocab_size=budget,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
    )
    trainer_tok.train_from_iterator((corpus or TRAINING_CORPUS).split("\n\n"), trainer=trainer)
    data = json.loads(trainer_tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    pieces = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in data["model"]["merges"]]
    return pieces, merges


def _build_tokenizer(vocab_size: int, corpus: str | None = None) -> Tokenizer:
    vocab: dict[str, int] = {text: idx for text, idx in SPECIAL_TOKENS.values()}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = BYTE_TOKEN_OFFSET + b
    pieces, merges = _train_merges(vocab_size - _FIRST_LEARNED_ID, corpus=corpus)
    for piece in pieces:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for the corpus alphabet (needs {len(vocab)})")
    # Fill up to exactly vocab_size with pieces no merge produces (only reachable as literal text).
    while len(vocab) < vocab_size:
        vocab[f"<unused{len(vocab) - _FIRST_LEARNED_ID}>"] = len(vocab)
    # Every merge result must be in the vocabulary, and every merge part too.
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
    assert sorted(vocab.values()) == list(range(len(vocab)))

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", _SPACE_PIECE)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(
        [AddedToken(text, special=True, normalized=False)
         for text, _ in sorted(SPECIAL_TOKENS.values(), key=lambda t: t[1])]
    )
    bos, bos_id = SPECIAL_TOKENS["bos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    return tok


def build_tiny_gemma_tokenizer(out_dir: Path, vocab_size: int = 512, corpus: str | None = None) -> None:
    """Train the tiny Gemma-style tokenizer and write it as a HF tokenizer folder.

    Writes `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` into `out_dir`
    (created if needed); `transformers.AutoTokenizer.from_pretrained(out_dir)` loads it offline
    and adds `<bos>` in front of encoded text. `corpus`: the text to learn the pieces on
    (default: the small embedded one).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(vocab_size, corpus)
    tok.save(str(out_dir / "tokenizer.json"))

    name = {k: v[0] for k, v in SPECIAL_TOKENS.items()}
    config = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": name["bos"],
        "eos_token": name["eos"],
        "pad_token": name["pad"],
        "unk_token": name["unk"],
        "mask_token": name["mask"],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "padding_side": "left",
        "model_max_length": 131072,
        "extra_special_tokens": {
            "sot_token": name["start_of_turn"],
            "eot_token": name["end_of_turn"],
            "boi_token": name["boi"],
            "eoi_token": name["eoi"],
            "image_token": name["image"],
            "boa_token": name["boa"],
            "eoa_token": name["eoa"],
            "audio_token": name["audio"],
            "video_token": name["video"],
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(GEMMA4_CHAT_TEMPLATE, encoding="utf-8")


# Llama-2's fixed ids: <unk>, <s>, </s>, then the 256 byte pieces, then the learned pieces.
LLAMA2_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# Phi-3's chat tokens, added after the model vocabulary in Phi-3's order (all special).
PHI3_ADDED_TOKENS = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                     "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")
PHI3_GENERATION_EOS = ("<|endoftext|>", "<|assistant|>", "<|end|>")


def build_tiny_sentencepiece_tokenizer(out_dir: Path, style: str = "llama2", vocab_size: int = 512) -> None:
    """A tiny tokenizer with the structure of Llama-2's (``style="llama2"``) or Phi-3's
    (``"phi3"``) ``tokenizer.json``, trained on the corpus above.

    BPE with byte fallback over ``<unk> <s> </s>``, the 256 byte pieces and the learned pieces;
    normalizer ``Prepend("▁")`` + ``Replace(" ", "▁")``, no pre-tokenizer; decoder ``Replace("▁",
    " ")``, ``ByteFallback``, ``Fuse``, ``Strip(" ", 1, 0)`` (the decoded text loses its first
    space); ``<s>`` prepended by the post-processor. Phi-3 adds its chat tokens after the model
    vocabulary and ends generation on ``<|endoftext|>``, ``<|assistant|>`` and ``<|end|>``
    (generation_config.json). tokenizer_config.json names ``PreTrainedTokenizerFast``, so
    transformers uses this file as written (the real configs name ``LlamaTokenizer``, for which
    transformers 5 replaces the normalizer by a ``Metaspace(prepend_scheme="first")``
    pre-tokenizer: the same decoder, but text after a special token encodes without "▁").
    """
    if style not in ("llama2", "phi3"):
        raise ValueError(f"unknown SentencePiece style {style!r}; choose 'llama2' or 'phi3'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab: dict[str, int] = {text: i for i, text in enumerate(LLAMA2_SPECIAL_TOKENS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(LLAMA2_SPECIAL_TOKENS) + b
    pieces, merges = _train_merges(vocab_size - len(vocab), words=True)
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE_PIECE), normalizers.Replace(" ", _SPACE_PIECE)])
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA2_SPECIAL_TOKENS])
    if style == "phi3":
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in PHI3_ADDED_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(out_dir / "tokenizer.json"))
    eos = "<|endoftext|>" if style == "phi3" else "</s>"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": eos,
              "unk_token": "<unk>", "pad_token": eos if style == "phi3" else None, "add_bos_token": True,
              "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 4096}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if style == "phi3":
        ids = [tok.token_to_id(t) for t in PHI3_GENERATION_EOS]
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}, indent=2) + "\n",
                                                        encoding="utf-8")
