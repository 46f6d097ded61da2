"""The tiny Gemma tokenizer, and MNN 3.6.1's runtime reading our exported tokenizer file.

One child process drives the runtime (see tests/mnn_dummy.py) for all MNN-side results; the
tests compare them with transformers.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # allow running without installing the package
    sys.path.insert(0, str(_ROOT))

from transformers import AutoTokenizer  # noqa: E402

from llmexport.mnn.tokenizer.writer import write_mnn_tokenizer  # noqa: E402
from llmexport.models.gemma4.family import END_OF_TURN_TOKENS, MINJA_CHAT_TEMPLATE  # noqa: E402
from llmexport.tiny.tokenizer import (  # noqa: E402
    BYTE_TOKEN_OFFSET,
    SPECIAL_TOKENS,
    TRAINING_CORPUS,
    build_tiny_gemma_tokenizer,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mnn_dummy import run_mnn_script  # noqa: E402

BOS_ID = SPECIAL_TOKENS["bos"][1]
MNN_TOKENIZER_FILE = "tokenizer.mtok"

FIXED_TEXTS = [
    "",
    " ",
    "   ",
    "Hello world",
    "Hello, world! How are you?",
    " leading space",
    "trailing space ",
    "multiple    spaces   inside",
    "tabs\tand\t\ttabs",
    "new\nlines\n\n\nand\r\nCRLF",
    "mixed \t \n whitespace",
    "Numbers 0123456789 3.14159 -42 1e-6 $19.99 50%",
    "punctuation: !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "Grüße aus München, schöne Straße! ÄÖÜäöüß",
    "我们今天去公园散步。你好，世界！",
    "日本語のテキスト",  # characters outside the corpus: byte fallback
    "Emoji 😀🎉👍 family 👩‍👩‍👧 flag 🇩🇪 heart ❤️",
    "Ω≈ç√∫ ñ é é (composed vs decomposed)",
    "non\u00a0breaking\u2009thin space",
    "def add(a, b):\n    return a + b\n",
    'x = {"key": [1, 2, 3]}  # comment',
    "<|turn>user\nhi<turn|>",
    "<bos><|turn>system\nBe brief.<turn|>\n<|turn>model\n",
    "<eos>text<pad><unk><mask>",
    "<|image><|image|><|image|><image|> describe",
    "<|audio><|audio|><audio|><|video|>",
    "a<|image|>b<|turn>c",
    "<|turn <turn| <|image <|imag> <bos",  # near misses of special tokens
    "literal byte piece <0x41> and <unused3>",
    "already ▁ normalized ▁▁ text",
    "\u200b zero width, \ufeff bom",
]

CHATS = {
    "user": [{"role": "user", "content": "Hi there!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Wie geht's? 你好 😀"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of  Germany?\nThanks"},
    ],
}


def _fuzz_texts(count: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    pieces = sorted(set(TRAINING_CORPUS)) + [
        " ", "  ", "\t", "\n", "\r\n", "Ω", "日本", "👩‍👧", "é", "\u00a0", "▁", "<", "|", ">",
        "<|turn>", "<turn|>", "<bos>", "<eos>", "<|image|>", "<|image>", "<image|>", "<|audio|>",
        "the ", "model", "Über", "模型", "12",
    ]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(count)]


ALL_TEXTS = FIXED_TEXTS + TRAINING_CORPUS.split("\n") + [TRAINING_CORPUS] + _fuzz_texts(300)

_MNN_BODY = """
from mnn_dummy import write_dummy_mnn_model
cfg = write_dummy_mnn_model(P["mnn_dir"], P["tokenizer_file"], P["vocab_size"],
                            jinja={"chat_template": P["template"], "bos": "<bos>", "eos": "<turn|>"})
m = L.create(str(cfg))
m.set_config(json.dumps({"sampler_type": "greedy", "max_new_tokens": 1}))
m.load()
RESULT = {"encode": [m.tokenizer_encode(t) for t in P["texts"]]}
decoded = []
for i in range(P["vocab_size"]):
    try:
        decoded.append(m.tokenizer_decode(i))
    except UnicodeDecodeError:
        decoded.append(None)
RESULT["decode"] = decoded
RESULT["chat"] = {name: m.apply_chat_template(msgs) for name, msgs in P["chats"].items()}
RESULT["chat_ids"] = {name: m.tokenizer_encode(text) for name, text in RESULT["chat"].items()}
RESULT["chat_str"] = m.apply_chat_template("Hi there!")
m._c_obj.response("Hi there!", False, 1)  # max_new_tokens=1
m._c_obj.set_context({"generate_str": ""})  # get_context() crashes on non-UTF-8 generated text
RESULT["history"] = m._c_obj.get_context()["history_tokens"]
RESULT["variants"] = {}
for name, folder in P["variants"].items():
    cfg = write_dummy_mnn_model(folder, P["tokenizer_file"], P["vocab_size"],
                                jinja={"chat_template": P["template"], "bos": "<bos>", "eos": "<turn|>"})
    v = L.create(str(cfg))
    v.load()
    text = v.apply_chat_template(P["chats"]["user"])
    RESULT["variants"][name] = {"chat": text, "chat_ids": v.tokenizer_encode(text), "hi": v.tokenizer_encode("hi")}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    hf_dir = root / "hf"
    build_tiny_gemma_tokenizer(hf_dir)
    mnn_dir = root / "mnn"
    written = write_mnn_tokenizer(hf_dir, mnn_dir / MNN_TOKENIZER_FILE, end_of_turn=END_OF_TURN_TOKENS)
    # Variants that pin down where the runtime's BOS comes from (see test_bos_variants).
    write_mnn_tokenizer(hf_dir, root / "prefix" / MNN_TOKENIZER_FILE, bos_prefix=True)
    no_bos_dir = root / "hf_no_bos"
    no_bos_dir.mkdir()
    (no_bos_dir / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["bos_token"]
    (no_bos_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    write_mnn_tokenizer(no_bos_dir, root / "no_bos" / MNN_TOKENIZER_FILE)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    mnn = run_mnn_script(
        _MNN_BODY,
        {
            "work_dir": str(root / "child"),
            "mnn_dir": str(mnn_dir),
            "tokenizer_file": MNN_TOKENIZER_FILE,
            "vocab_size": len(tok),
            "template": MINJA_CHAT_TEMPLATE,
            "texts": ALL_TEXTS,
            "chats": CHATS,
            "variants": {"prefix": str(root / "prefix"), "no_bos": str(root / "no_bos")},
        },
    )
    return {"hf_dir": hf_dir, "mnn_dir": mnn_dir, "tok": tok, "mnn": mnn, "written": written}


def _chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --- the tiny HF tokenizer itself -------------------------------------------------------------


def test_tiny_tokenizer_is_deterministic(tmp_path, tiny):
    build_tiny_gemma_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny["hf_dir"] / name).read_bytes(), name


def test_tiny_tokenizer_layout(tiny):
    tok = tiny["tok"]
    assert len(tok) == 512
    for name, (text, idx) in SPECIAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(text) == idx, name
    for b in (0, 0x41, 0xFF):
        assert tok.convert_tokens_to_ids(f"<0x{b:02X}>") == BYTE_TOKEN_OFFSET + b
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (2, 1, 0, 3)
    assert tok.image_token_id == SPECIAL_TOKENS["image"][1]
    assert tok.boi_token == "<|image>" and tok.eoi_token == "<image|>"
    assert tok.audio_token_id == SPECIAL_TOKENS["audio"][1]
    spec = json.loads((tiny["hf_dir"] / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["type"] == "BPE" and spec["model"]["byte_fallback"] is True
    assert spec["normalizer"] == {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}


def test_tiny_tokenizer_adds_bos_and_round_trips(tiny):
    tok = tiny["tok"]
    for text in FIXED_TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1 + text.count("<bos>")
        assert tok.decode(ids[1:]) == text.replace("\u2581", " ")
    # characters outside the training corpus fall back to bytes, never <unk>
    assert SPECIAL_TOKENS["unk"][1] not in tok("日本語 🇩🇪")["input_ids"]


def test_hf_chat_template_format(tiny):
    text = tiny["tok"].apply_chat_template(CHATS["multi_turn"], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><|turn>system\nAnswer in one word.<turn|>\n"
        "<|turn>user\nCapital of France?<turn|>\n"
        "<|turn>model\nParis<turn|>\n"
        "<|turn>user\nAnd of  Germany?\nThanks<turn|>\n"
        "<|turn>model\n"
    )
    no_prompt = tiny["tok"].apply_chat_template(CHATS["user"], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<bos><|turn>user\nHi there!<turn|>\n"


# --- the MNN tokenizer file against transformers ------------------------------------------------


def test_mnn_encode_matches_hf(tiny):
    tok = tiny["tok"]
    mismatches = []
    for text, got in zip(ALL_TEXTS, tiny["mnn"]["encode"]):
        want = tok(text, add_special_tokens=False)["input_ids"]
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, mismatches[:5]


def test_mnn_encode_is_hf_encode_without_bos(tiny):
    # The file carries no prefix token: HF's tokenizer(text) is [BOS] + the runtime's encode(text).
    tok = tiny["tok"]
    for text, got in zip(FIXED_TEXTS, tiny["mnn"]["encode"]):
        assert tok(text)["input_ids"] == [BOS_ID] + got


def test_mnn_decode_matches_hf_per_token(tiny):
    tok = tiny["tok"]
    decoder = tok.backend_tokenizer.decoder
    for idx, got in enumerate(tiny["mnn"]["decode"]):
        piece = tok.convert_ids_to_tokens(idx)
        if BYTE_TOKEN_OFFSET <= idx < BYTE_TOKEN_OFFSET + 256:
            byte = idx - BYTE_TOKEN_OFFSET
            # The Python binding returns a C string: NUL comes back empty, a lone byte >= 0x80
            # is not valid UTF-8 and raises.
            assert got == ("" if byte == 0 else None if byte >= 0x80 else chr(byte)), piece
        else:
            assert got == decoder.decode([piece]), (idx, piece)


def test_mnn_decode_round_trip(tiny):
    tok = tiny["tok"]
    decoded = tiny["mnn"]["decode"]
    checked = 0
    for text, ids in zip(ALL_TEXTS, tiny["mnn"]["encode"]):
        parts = [decoded[i] for i in ids]
        if any(p is None for p in parts):
            continue  # a multi-byte character split over byte pieces: not decodable id by id
        assert "".join(parts) == tok.decode(ids, skip_special_tokens=False), text
        checked += 1
    assert checked > len(ALL_TEXTS) // 2


@pytest.mark.parametrize("name", sorted(CHATS))
def test_mnn_chat_template_matches_hf(tiny, name):
    want = tiny["tok"].apply_chat_template(CHATS[name], tokenize=False, add_generation_prompt=True)
    assert tiny["mnn"]["chat"][name] == want


def test_mnn_chat_prompt_has_exactly_one_bos(tiny):
    # `{{ bos_token }}` renders "<bos>" (from the tokenizer file), which encodes to the one BOS.
    tok = tiny["tok"]
    for name, messages in CHATS.items():
        hf_ids = _chat_ids(tok, messages)
        assert hf_ids[0] == BOS_ID and hf_ids.count(BOS_ID) == 1
        assert tiny["mnn"]["chat_ids"][name] == hf_ids, name


def test_mnn_response_feeds_one_bos(tiny):
    # Llm::response(str) applies the template (system_prompt is empty by default), encodes and
    # prefills: the history holds the prompt ids plus one generated id.
    tok = tiny["tok"]
    assert tiny["mnn"]["chat_str"] == tok.apply_chat_template(CHATS["user"], tokenize=False, add_generation_prompt=True)
    want = _chat_ids(tok, CHATS["user"])
    history = tiny["mnn"]["history"]
    assert history[: len(want)] == want
    assert len(history) == len(want) + 1
    assert history.count(BOS_ID) == 1


def test_stop_ids_are_eos_and_the_family_end_of_turn(tiny):
    header = (tiny["mnn_dir"] / MNN_TOKENIZER_FILE).read_bytes().split(b"\n")[:3]
    n_special, n_stop, _ = map(int, header[1].split())
    stops = list(map(int, header[2].split()))[n_special:n_special + n_stop]
    assert stops == [SPECIAL_TOKENS["eos"][1], SPECIAL_TOKENS["end_of_turn"][1]] == list(tiny["written"].stop_ids)
    assert tiny["written"].notes == () and tiny["written"].unsafe_chars == frozenset()


def test_bos_variants(tiny):
    """Facts about MNN 3.6.1 that decide the default export (no prefix token, bos in the file).

    - Prefix ids from the file header go in front of every encode() (tokenizer.cpp:192), so a
      bos prefix plus a template writing `{{ bos_token }}` gives two BOS.
    - `bos_token` in templates comes only from the tokenizer file's trailer (tokenizer.cpp:992);
      llm_config.json's `jinja.bos` is not read (llm.cpp:120 passes chat_template, eos, context).
    """
    hf_ids = _chat_ids(tiny["tok"], CHATS["user"])
    prefix = tiny["mnn"]["variants"]["prefix"]
    assert prefix["hi"][0] == BOS_ID
    assert prefix["chat_ids"] == [BOS_ID] + hf_ids  # double BOS
    no_bos = tiny["mnn"]["variants"]["no_bos"]
    assert not no_bos["chat"].startswith("<bos>")
    assert no_bos["chat_ids"] == hf_ids[1:]  # no BOS at all, despite jinja.bos in llm_config.json


# --- writer errors --------------------------------------------------------------------------------


def _mutated(tiny, tmp_path, mutate) -> Path:
    spec = json.loads((tiny["hf_dir"] / "tokenizer.json").read_text(encoding="utf-8"))
    mutate(spec)
    folder = tmp_path / "mutated"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (folder / "tokenizer_config.json").write_bytes((tiny["hf_dir"] / "tokenizer_config.json").read_bytes())
    return folder


def test_unsupported_model_type_names_file(tiny, tmp_path):
    def to_wordpiece(spec):
        spec["model"] = {"type": "WordPiece", "vocab": spec["model"]["vocab"], "unk_token": "<unk>"}

    folder = _mutated(tiny, tmp_path, to_wordpiece)
    with pytest.raises(ValueError, match=r"tokenizer\.json.*WordPiece"):
        write_mnn_tokenizer(folder, tmp_path / "out.mtok")


def test_unsupported_normalizer_raises(tiny, tmp_path):
    def nfkc(spec):
        spec["normalizer"] = {"type": "NFKC"}

    folder = _mutated(tiny, tmp_path, nfkc)
    with pytest.raises(ValueError, match="NFKC"):
        write_mnn_tokenizer(folder, tmp_path / "out.mtok")


def test_missing_tokenizer_json_raises(tmp_path):
    from llmexport.errors import InputError

    with pytest.raises(InputError, match="tokenizer.json"):
        write_mnn_tokenizer(tmp_path, tmp_path / "out.mtok")
