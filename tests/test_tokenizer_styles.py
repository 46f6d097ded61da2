"""Byte-level BPE tokenizers (GPT-2, Llama-3, Qwen, LFM2 styles) through MNN 3.6.1's runtime vs transformers.

Per style, two tokenizers go through the exporter's writer and the runtime:
* the trained tiny tokenizer (llmexport.tiny.byte_level_tokenizer), as the model ships it;
* a *pair probe*: the same normalizer, pre-tokenizer and added tokens over a vocabulary of every
  byte and every byte pair (merges in a shuffled order), so that a different split of the text
  almost always changes the ids (a trained vocabulary has no merge across most boundaries).
Exactness is claimed for text without the characters the writer reports as unsafe (see
mnn/tokenizer/regex.py), and for Qwen's NFC normalizer on text in NFC (the runtime cannot apply it).
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tokenizer import CHATS, FIXED_TEXTS
from transformers import AutoTokenizer

from llmexport.mnn.tokenizer.byte_level import byte_level_chars
from llmexport.mnn.tokenizer.pipeline import NFC_NOTE
from llmexport.mnn.tokenizer.writer import write_mnn_tokenizer
from llmexport.tiny.byte_level_tokenizer import EXTRA_CORPUS, STYLES, build_byte_level_tokenizer
from llmexport.tiny.tokenizer import TRAINING_CORPUS

from mnn_tokenizer_server import MnnTokenizer

CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'rE", "'ve", "'VE", "'vE", "'m", "'M", "'ll", "'LL",
                "'Ll", "'d", "'D", "'x", "'"]
WORDS = sorted(set((TRAINING_CORPUS + EXTRA_CORPUS).split()))


def _corpus(spec) -> list[str]:
    added = list(spec.specials + spec.plain_added)
    rng = random.Random(7)
    pieces = WORDS + CONTRACTIONS + added + [" ", "  ", "\t", "\n", "\r\n", "\n\n", "123", "4567", "\u00a0", "\u3000",
                                             "e\u0301", "\u0301", "日本", "👩\u200d👧", "❤\ufe0f", "<|", "|>"]
    fuzz = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(400)]
    specials = ["".join(added), f"x{added[0]}y {added[-1]}z", f" {added[0]} ", added[0][:-1]]
    return FIXED_TEXTS + (TRAINING_CORPUS + EXTRA_CORPUS).split("\n") + specials + fuzz


def _pair_probe(tj: dict) -> dict:
    """``tj`` with a vocabulary of all bytes and byte pairs; the added tokens move behind it."""
    chars = byte_level_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    pairs = [(a, b) for a in chars for b in chars]
    random.Random(0).shuffle(pairs)
    for a, b in pairs:
        vocab[a + b] = len(vocab)
    probe = json.loads(json.dumps(tj))
    probe["model"].update(vocab=vocab, merges=[list(p) for p in pairs])
    for i, tok in enumerate(probe["added_tokens"]):
        tok["id"] = len(vocab) + i
    if probe.get("post_processor") and "TemplateProcessing" in json.dumps(probe["post_processor"]):
        probe["post_processor"] = None
    return probe


def _side(folder: Path, spec, tj_text: str | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    if tj_text is not None:
        (folder / "tokenizer.json").write_text(tj_text, encoding="utf-8")
    written = write_mnn_tokenizer(folder, folder / "tokenizer.mtok", end_of_turn=(spec.end_of_turn,))
    tok = AutoTokenizer.from_pretrained(folder)
    jinja = {"chat_template": spec.chat_template, "eos": spec.eos} if spec.chat_template else None
    return written, tok, MnnTokenizer(folder / "runtime", "../tokenizer.mtok", len(tok), jinja=jinja)


def _build_style(name: str, root: Path) -> SimpleNamespace:
    spec = build_byte_level_tokenizer(root / "trained", name, vocab_size=4000)
    written, tok, mnn = _side(root / "trained", spec)
    probe_dir = root / "probe"
    probe_dir.mkdir()
    (probe_dir / "tokenizer_config.json").write_bytes((root / "trained" / "tokenizer_config.json").read_bytes())
    tj = json.loads((root / "trained" / "tokenizer.json").read_text(encoding="utf-8"))
    _, probe_tok, probe_mnn = _side(probe_dir, spec, json.dumps(_pair_probe(tj)))
    return SimpleNamespace(name=name, spec=spec, written=written, tok=tok, mnn=mnn, probe_tok=probe_tok,
                           probe_mnn=probe_mnn, root=root, nfc=NFC_NOTE in written.notes, corpus=_corpus(spec))


@pytest.fixture(scope="module")
def styles(tmp_path_factory):
    """``styles(name)`` -> the built style (tokenizers, runtime children), built once per module."""
    built: dict[str, SimpleNamespace] = {}

    def get(name: str) -> SimpleNamespace:
        if name not in built:
            built[name] = _build_style(name, tmp_path_factory.mktemp(f"style-{name}"))
        return built[name]

    yield get
    for style in built.values():
        style.mnn.close()
        style.probe_mnn.close()


@pytest.fixture(scope="module", params=sorted(STYLES))
def style(request, styles):
    return styles(request.param)


def _runtime_input(style, text: str) -> str:
    return unicodedata.normalize("NFC", text) if style.nfc else text


def _is_safe(style, text: str) -> bool:
    return not set(_runtime_input(style, text)) & style.written.unsafe_chars


def _mismatches(style, tok, mnn, texts):
    got = mnn.encode([_runtime_input(style, t) for t in texts])
    return [(t, g, tok(t, add_special_tokens=False)["input_ids"]) for t, g in zip(texts, got)
            if g != tok(t, add_special_tokens=False)["input_ids"]]


def test_style_structure(style):
    tj = json.loads((style.root / "trained" / "tokenizer.json").read_text(encoding="utf-8"))
    assert tj["model"]["byte_fallback"] is False and tj["decoder"]["type"] == "ByteLevel"
    assert tj["model"]["ignore_merges"] is (style.spec.text == "llama3")
    assert (tj["normalizer"] or {}).get("type") == ("NFC" if style.spec.text == "qwen" else None)
    assert ("TemplateProcessing" in json.dumps(tj["post_processor"])) is style.spec.adds_bos
    assert len(tj["model"]["merges"]) > 300


@pytest.mark.parametrize("which", ["trained", "probe"])
def test_encode_matches_hf_on_the_corpus(style, which):
    tok, mnn = (style.tok, style.mnn) if which == "trained" else (style.probe_tok, style.probe_mnn)
    safe = [t for t in style.corpus if _is_safe(style, t)]
    assert len(safe) > 0.95 * len(style.corpus)
    assert _mismatches(style, tok, mnn, safe) == []


def test_text_not_in_nfc(style):
    """Qwen: the runtime encodes raw text as HF would without its NFC normalizer (the documented
    difference); the other styles have no normalizer and agree on it too."""
    raw = [t for t in style.corpus if unicodedata.normalize("NFC", t) != t and _is_safe(style, t)]
    assert len(raw) >= 5
    got = style.probe_mnn.encode(raw)
    hf = [style.probe_tok(t, add_special_tokens=False)["input_ids"] for t in raw]
    if not style.nfc:
        assert got == hf
        return
    tj = json.loads((style.root / "probe" / "tokenizer.json").read_text(encoding="utf-8"))
    tj["normalizer"] = None
    from tokenizers import Tokenizer

    without_nfc = Tokenizer.from_str(json.dumps(tj))
    assert got == [without_nfc.encode(t, add_special_tokens=False).ids for t in raw]
    assert all(g != h for g, h in zip(got, hf))


def test_unsafe_characters_do_split_differently(style):
    """The exclusions are real: each kind of reported character changes some split (the pair
    probe makes that visible unless its merge ranks happen to give the same ids)."""
    kinds = {"White_Space beyond Zs": ["a\u2028\u2028b", "x\x85\x85y", "a \u2029\u2029"],
             "fold marker": ["x\x01y z", "ab\x01", "\x01\x01a", "a\x02b 1\x021", "x\x03\x03y"],
             "Unicode 16 letter": ["\u1c89\u1c89!", "!\u1c89\u1c89", "a\U000105c0b!"]}
    if style.name != "gpt2":
        kinds["case folding"] = ["it'\u017ft", "'\u017fx", "x'\u017fab"]  # (?i:'s) matches 'ſ in HF only
    for kind, texts in kinds.items():
        assert all(set(t) & style.written.unsafe_chars for t in texts), kind
        got = style.probe_mnn.encode(texts)
        assert any(ids != style.probe_tok(t, add_special_tokens=False)["input_ids"] for t, ids in zip(texts, got)), kind


def _piece_text(tok, idx: int) -> str | None:
    """What one id decodes to: the bytes of its byte-level piece (None: not valid UTF-8; the
    Python binding returns a C string, so NUL comes back empty)."""
    piece = tok.convert_ids_to_tokens(idx)
    if idx in tok.added_tokens_decoder:
        return piece
    char_bytes = {c: b for b, c in enumerate(byte_level_chars())}
    try:
        return bytes(char_bytes[c] for c in piece).decode("utf-8").replace("\x00", "")
    except UnicodeDecodeError:
        return None


def test_decode_matches_hf_per_token(style):
    ids = list(range(len(style.tok)))
    got = style.mnn.decode(ids)
    want = [_piece_text(style.tok, i) for i in ids]
    assert got == want
    assert sum(w is None for w in want) > 10  # partial UTF-8 pieces exist and are handled as such


def test_decode_round_trips(style):
    safe = [_runtime_input(style, t) for t in style.corpus if _is_safe(style, t)]
    encoded = style.mnn.encode(safe)
    assert [style.tok.decode(ids) for ids in encoded] == safe
    pieces = style.mnn.decode(sorted({i for ids in encoded for i in ids}))
    by_id = dict(zip(sorted({i for ids in encoded for i in ids}), pieces))
    whole = [(t, ids) for t, ids in zip(safe, encoded) if all(by_id[i] is not None for i in ids)]
    assert len(whole) >= 100
    assert all("".join(by_id[i] for i in ids) == t for t, ids in whole)


def test_stop_ids_come_from_eos_and_the_family(style):
    header = (style.root / "trained" / "tokenizer.mtok").read_bytes().split(b"\n")[:3]
    n_special, n_stop, n_prefix = map(int, header[1].split())
    ids = list(map(int, header[2].split()))
    assert n_prefix == 0
    want = [style.tok.convert_tokens_to_ids(t) for t in dict.fromkeys((style.spec.eos, style.spec.end_of_turn))]
    assert ids[n_special:n_special + n_stop] == want == list(style.written.stop_ids)
    assert set(ids[:n_special]) == {style.tok.convert_tokens_to_ids(t) for t in style.spec.specials}


@pytest.mark.parametrize("name", sorted(n for n, spec in STYLES.items() if spec.chat_template))
def test_chat_template_renders_and_encodes_as_hf(styles, name):
    style = styles(name)
    rendered = style.mnn.chat(CHATS)
    for name, messages in CHATS.items():
        want = style.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered[name] == want, name
    got = style.mnn.encode([rendered[n] for n in sorted(CHATS)])
    for name, ids in zip(sorted(CHATS), got):
        hf = style.tok.apply_chat_template(CHATS[name], tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ids == list(hf), name


# --- random strings ---------------------------------------------------------------------------

_CHARS = st.one_of(
    st.characters(categories=["L", "N", "M", "P", "S", "Zs"]),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(categories=["Mn", "Mc"]),  # combining marks
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
    st.sampled_from(["\t", "\n", "\r", "\x0b", "\x0c", "\x08", "\x1f", "\x7f", "\u200d", "\ufe0f", "\u00a0"]),
)
_PIECES = st.one_of(
    _CHARS, st.sampled_from(CONTRACTIONS), st.sampled_from(WORDS), st.text("0123456789", min_size=1, max_size=7),
    st.text(" \t\n\r", min_size=1, max_size=5), st.text(alphabet=_CHARS, min_size=1, max_size=6),
)


def _texts(style):
    added = st.sampled_from(list(style.spec.specials + style.spec.plain_added))
    return st.lists(st.one_of(_PIECES, added), min_size=1, max_size=24).map("".join)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_strings_encode_as_hf(style, data):
    text = data.draw(_texts(style).filter(lambda t: _is_safe(style, t)))
    runtime_text = _runtime_input(style, text)
    got_probe, got = style.probe_mnn.encode([runtime_text]) + style.mnn.encode([runtime_text])
    assert got_probe == style.probe_tok(text, add_special_tokens=False)["input_ids"]
    assert got == style.tok(text, add_special_tokens=False)["input_ids"]


# --- what the writer refuses ------------------------------------------------------------------

def _mutated(style, tmp_path: Path, mutate) -> Path:
    tj = json.loads((style.root / "trained" / "tokenizer.json").read_text(encoding="utf-8"))
    mutate(tj)
    folder = tmp_path / "mutated"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    (folder / "tokenizer_config.json").write_bytes((style.root / "trained" / "tokenizer_config.json").read_bytes())
    return folder


def _add_unreachable_word(tj: dict) -> None:
    """Give the vocabulary a word ("zq") that no merge produces; added tokens move up one id."""
    vocab = tj["model"]["vocab"]
    assert "zq" not in vocab and ["z", "q"] not in tj["model"]["merges"]
    vocab["zq"] = len(vocab)
    for tok in tj["added_tokens"]:
        tok["id"] += 1


def test_ignore_merges_with_an_unreachable_word_is_refused(styles, tmp_path, monkeypatch):
    from llmexport.mnn.tokenizer import pipeline as tokenizer_pipeline

    style = styles("llama3")
    folder = _mutated(style, tmp_path, _add_unreachable_word)
    hf = AutoTokenizer.from_pretrained(folder)
    zq = hf.convert_tokens_to_ids("zq")
    with pytest.raises(ValueError, match=r"ignore_merges=true: 1 vocabulary word\(s\) such as \['zq'\]"):
        write_mnn_tokenizer(folder, tmp_path / "out.mtok")
    # The refusal is needed: written anyway, the runtime spells the word with its merges.
    monkeypatch.setattr(tokenizer_pipeline, "unreachable_words", lambda tj: [])
    write_mnn_tokenizer(folder, folder / "tokenizer.mtok")
    mnn = MnnTokenizer(folder / "runtime", "../tokenizer.mtok", len(hf))
    try:
        assert mnn.encode(["zq"]) == [[hf.convert_tokens_to_ids("z"), hf.convert_tokens_to_ids("q")]]
        assert hf("zq", add_special_tokens=False)["input_ids"] == [zq]  # HF: the whole word is one token
    finally:
        mnn.close()


def test_ignore_merges_without_unreachable_words_is_accepted(styles):
    from llmexport.mnn.tokenizer.pipeline import unreachable_words

    tj = json.loads((styles("llama3").root / "trained" / "tokenizer.json").read_text(encoding="utf-8"))
    assert tj["model"]["ignore_merges"] and unreachable_words(tj) == []


REFUSALS = {
    "add_prefix_space": (lambda tj: tj["pre_tokenizer"].update(add_prefix_space=True), "add_prefix_space=true"),
    "missing byte": (lambda tj: tj["model"]["vocab"].update({"<unused>": tj["model"]["vocab"].pop("Ā")}),
                     "lacks 1 byte character"),
    "no byte fallback, no ByteLevel": (lambda tj: tj.update(pre_tokenizer=None), "without byte_fallback"),
    "MergedWithNext": (lambda tj: tj.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "MergedWithNext", "invert": False},
        tj["pre_tokenizer"]]}), "behavior 'MergedWithNext'"),
    "Split after ByteLevel": (lambda tj: tj.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        tj["pre_tokenizer"], {"type": "Split", "pattern": {"String": "x"}, "behavior": "Isolated"}]}),
        "'Split' after ByteLevel"),
    "NFKC": (lambda tj: tj.update(normalizer={"type": "NFKC"}), "normalizer 'NFKC'"),
    "overlapping added tokens": (lambda tj: tj["added_tokens"].append(
        {"id": max(t["id"] for t in tj["added_tokens"]) + 1, "content": "text|>x", "special": False,
         "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}), "can overlap the special"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_writer_refuses_what_the_runtime_reads_differently(styles, tmp_path, case):
    mutate, message = REFUSALS[case]
    folder = _mutated(styles("gpt2"), tmp_path, mutate)
    with pytest.raises(ValueError, match=r"tokenizer\.json: unsupported .*" + re.escape(message)):
        write_mnn_tokenizer(folder, tmp_path / "out.mtok")
