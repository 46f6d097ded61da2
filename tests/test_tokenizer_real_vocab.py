"""Real vocabularies (llama.cpp's GGUF test vocabularies, tests/real_vocab_tokenizers.py) through
the exporter's tokenizer writer and MNN 3.6.1's runtime, against HF's ``tokenizers``.

Per vocabulary: the rebuilt tokenizer.json gives the ids of the ``.out`` file on every ``.inp``
case (the rebuild is the real tokenizer); the exporter either refuses it with its one-line reason
(``REFUSED``) or writes a file whose runtime encode equals HF's encode (``add_special_tokens=False``)
on the ``.inp`` cases, a multilingual/code/whitespace corpus and random strings made of the
vocabulary's own pieces, and whose runtime single-id decode is the one mnn/tokenizer/stream.py
predicts, so that the streamed text is HF's decode up to its documented differences. Text with
characters the writer reports as unsafe is left out (and counted); Qwen2's NFC normalizer is
applied to the runtime's input (the documented note).
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
from real_vocab_tokenizers import SPECS, rebuild
from test_tokenizer import FIXED_TEXTS
from tokenizers import Tokenizer

from llmexport.mnn.tokenizer.pipeline import NFC_NOTE
from llmexport.mnn.tokenizer.stream import StreamModel, streamed_text_difference
from llmexport.mnn.tokenizer.whole_words import APPROXIMATE_FLAG, random_piece_strings
from llmexport.mnn.tokenizer.writer import STRIP_DIFFERENCES, convert_tokenizer, write_mnn_tokenizer
from llmexport.tiny.byte_level_tokenizer import EXTRA_CORPUS
from llmexport.tiny.tokenizer import TRAINING_CORPUS

from mnn_tokenizer_server import MnnTokenizer
from real_vocab import real_vocab

#: Vocabulary -> a phrase of the exporter's one-line refusal.
REFUSED = {
    "llama-bpe": "ignore_merges=true: 588 vocabulary word(s)",  # and names --approximate_ignore_merges
    "falcon": "pre-tokenizer 'Punctuation'",
    "starcoder": "ByteLevel vocabulary lacks 14 byte character(s)",
}
EXPORTED = sorted(set(SPECS) - set(REFUSED))

CORPUS = FIXED_TEXTS + (TRAINING_CORPUS + EXTRA_CORPUS).split("\n") + [
    "Привет, мир! Как дела?", "مرحبا بالعالم", "नमस्ते दुनिया", "안녕하세요 세계", "Xin chào Việt Nam",
    "Ελληνικά κείμενα", "עברית", "ภาษาไทย", "Türkçe: Ayrıca çok güzel", "e\u0301 cafe\u0301 n\u0303",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n", "    if x:\n        return None\n\n\n",
    "SELECT * FROM t WHERE id = 42;", "<div class=\"x\">&nbsp;</div>", "a\r\nb\rc\n\nd", "\t\t  \n  \t",
    "1234567890 12 123 1234 12345", "3.14e-10 0x1F 0b1010", "It's we'll they're I'M YOU'LL", "   ", "\n",
]


def _build(name: str, root: Path, **options) -> SimpleNamespace:
    folder = rebuild(name, root)
    written = write_mnn_tokenizer(folder, folder / "tokenizer.mtok", **options)
    tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    mnn = MnnTokenizer(folder / "runtime", "../tokenizer.mtok", hf.get_vocab_size())
    model = StreamModel.from_tokenizer_json(tj, written.stop_ids, written.pieces)
    return SimpleNamespace(name=name, tj=tj, hf=hf, mnn=mnn, written=written, model=model,
                           nfc=NFC_NOTE in written.notes)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    built: dict[str, SimpleNamespace] = {}

    def get(name: str, **options) -> SimpleNamespace:
        key = f"{name}{sorted(options.items())}"
        if key not in built:
            built[key] = _build(name, tmp_path_factory.mktemp(f"real-{name}"), **options)
        return built[key]

    yield get
    for vocab in built.values():
        vocab.mnn.close()


def _hf_ids(vocab, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in vocab.hf.encode_batch(texts, add_special_tokens=False)]


def _encode_mismatches(vocab, texts: list[str]) -> tuple[list[tuple[str, list[int], list[int]]], int]:
    """(text, runtime ids, HF ids) where they differ, and how many texts were left out as unsafe."""
    safe = [t for t in texts if not set(t) & vocab.written.unsafe_chars]
    runtime_in = [unicodedata.normalize("NFC", t) if vocab.nfc else t for t in safe]
    got = vocab.mnn.encode(runtime_in)
    want = _hf_ids(vocab, safe)
    return [(t, g, w) for t, g, w in zip(safe, got, want) if g != w], len(texts) - len(safe)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_rebuild_gives_the_ids_hf_gave(name, tmp_path):
    hf = Tokenizer.from_file(str(rebuild(name, tmp_path) / "tokenizer.json"))
    cases = real_vocab(name).cases()
    assert len(cases) >= 40
    assert [(text, hf.encode(text, add_special_tokens=False).ids) for text, _ in cases] == cases


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_with_its_reason(name, tmp_path):
    folder = rebuild(name, tmp_path)
    with pytest.raises(ValueError) as err:
        convert_tokenizer(folder)
    message = str(err.value)
    assert message.startswith(f"{folder / 'tokenizer.json'}: unsupported ") and "\n" not in message
    assert REFUSED[name] in message
    if name == "llama-bpe":
        assert APPROXIMATE_FLAG in message


@pytest.mark.parametrize("name", EXPORTED)
def test_runtime_encode_matches_hf(exported, name):
    vocab = exported(name)
    cases = [text for text, _ in real_vocab(name).cases()]
    for texts in (cases, CORPUS, random_piece_strings(vocab.tj, 500)):
        bad, unsafe = _encode_mismatches(vocab, texts)
        assert unsafe <= len(texts) // 20
        assert bad == []


@pytest.mark.parametrize("name", EXPORTED)
def test_runtime_decode_is_the_stream_model(exported, name):
    """Single-id decode (what generation streams) equals mnn/tokenizer/stream.py's model on sampled ids
    and every added token, and the model's stream of HF's ids is HF's decode up to the documented
    differences."""
    vocab = exported(name)
    rng = random.Random(1)
    size = vocab.hf.get_vocab_size()
    ids = sorted({rng.randrange(size) for _ in range(3000)} | {t["id"] for t in vocab.tj["added_tokens"]})
    for i, text in zip(ids, vocab.mnn.decode(ids)):
        expected = vocab.model.piece_bytes(i)
        if text is None:  # not valid UTF-8 on its own
            with pytest.raises(UnicodeDecodeError):
                expected.decode("utf-8")
        else:
            assert text.encode("utf-8") == expected.split(b"\0")[0], i
    texts = CORPUS + random_piece_strings(vocab.tj, 300, seed=2)
    for text, hf_ids in zip(texts, _hf_ids(vocab, texts)):
        kept = vocab.model.streamed_ids(hf_ids)  # generation stops at a stop id
        hf_text = vocab.hf.decode(kept, skip_special_tokens=False)
        diff = streamed_text_difference(vocab.model, kept, vocab.model.stream_bytes(kept), hf_text)
        assert diff is None or diff.explained, (text, diff)


@pytest.mark.parametrize("name", ["deepseek-llm", "deepseek-coder"])
def test_added_tokens_decode_as_hf_does(exported, name):
    """DeepSeek's special tokens are spelled with "▁" (``<｜begin▁of▁sentence｜>``) and listed in
    the model vocabulary too; the runtime's single-id decode turns "▁" into a space unless the
    writer respells their rows. Every added token's single-id decode is HF's ``decode([id])``
    (but for the documented ``invalid_utf8`` difference), and its text still encodes to its one id."""
    vocab = exported(name)
    added = vocab.tj["added_tokens"]
    ids = [t["id"] for t in added]
    assert set(ids) <= set(vocab.tj["model"]["vocab"].values())
    respelled = [t["content"] for t in added if vocab.written.pieces[t["id"]] != t["content"]]
    assert respelled and respelled == [t["content"] for t in added if "\u2581" in t["content"]]
    got = dict(zip(ids, vocab.mnn.decode(ids)))
    want = {i: vocab.hf.decode([i], skip_special_tokens=False) for i in ids}
    # The 13 bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5-0xFF) are added tokens here: alone,
    # each streams as its raw byte (None: not UTF-8), where HF writes U+FFFD.
    lone = {i for i in ids if got[i] is None}
    assert len(lone) == 13 and all(len(vocab.model.piece_bytes(i)) == 1 and want[i] == "\ufffd" for i in lone)
    assert {streamed_text_difference(vocab.model, [i], vocab.model.piece_bytes(i), want[i]).kinds
            for i in lone} == {("invalid_utf8",)}
    assert {i: got[i] for i in ids if i not in lone} == {i: want[i] for i in ids if i not in lone}
    assert not set(ids) & set(vocab.model.piece_text_ids())
    contents = [t["content"] for t in added]
    assert vocab.mnn.encode(contents) == _hf_ids(vocab, contents) == [[i] for i in ids]


def test_phi3_rstrip_tokens_eat_the_whitespace(exported):
    """Phi-3's real added tokens have ``rstrip``: ``<|end|>\\n<|user|>`` is two ids in HF; the
    runtime's header special split would keep the newline, so these tokens stay out of it."""
    vocab = exported("phi-3")
    text = "<|end|>\n<|user|>\n  Hi</s> \t<|assistant|>"
    assert vocab.mnn.encode([text]) == _hf_ids(vocab, [text]) and _hf_ids(vocab, [text])[0][:2] == [32007, 32010]
    counts, ids = vocab.written.data.split(b"\n")[1:3]
    header = {int(i) for i in ids.split()[:int(counts.split()[0])]}
    assert header.isdisjoint({t["id"] for t in vocab.tj["added_tokens"] if t["rstrip"]})


def test_strip_whitespace_differences_are_the_listed_ones(exported):
    """Over every whitespace-like character, the runtime strips next to an rstrip token exactly
    what HF strips, except ``STRIP_DIFFERENCES`` (non-ASCII White_Space: C ``isspace`` is ASCII)."""
    vocab = exported("phi-3")
    chars = [chr(c) for c in range(0x3001) if chr(c).isspace() or chr(c) in STRIP_DIFFERENCES]
    texts = [f"<|end|>{c}x" for c in chars] + [f"a{c}<|end|>" for c in chars]
    got = vocab.mnn.encode(texts)
    differ = {t[7] if t.startswith("<|end|>") else t[1] for t, g, w in zip(texts, got, _hf_ids(vocab, texts)) if g != w}
    assert differ == STRIP_DIFFERENCES


def test_llama3_approximated_records_the_runtime_difference(exported):
    """Llama-3 with ``approximate_ignore_merges``: the runtime encodes as HF does without the
    whole-word lookup (on the corpus and the measured random strings), so the recorded mismatch
    count is exactly the runtime's against HF on those strings."""
    vocab = exported("llama-bpe", approximate_ignore_merges=True)
    diff = vocab.written.ignore_merges_difference
    assert diff is not None and len(diff.words) == 588 and " Arthropoda" in diff.words
    assert any(note.startswith("ignore_merges approximated: 588") for note in vocab.written.notes)
    spec = json.loads(json.dumps(vocab.tj))
    spec["model"]["ignore_merges"] = False
    merges_only = Tokenizer.from_str(json.dumps(spec))
    texts = random_piece_strings(vocab.tj, diff.random_strings)
    corpus = [t for t in CORPUS if not set(t) & vocab.written.unsafe_chars]
    assert not any(set(t) & vocab.written.unsafe_chars for t in texts)
    got = vocab.mnn.encode(texts + corpus)
    assert got == [e.ids for e in merges_only.encode_batch(texts + corpus, add_special_tokens=False)]
    assert sum(g != w for g, w in zip(got, _hf_ids(vocab, texts))) == diff.random_mismatches
    assert 0 < diff.mismatch_rate < 0.05
    words = vocab.mnn.encode(list(diff.words))
    assert all(len(ids) > 1 for ids in words)  # every affected word is split, as measured


def test_approximate_ignore_merges_flag_reaches_the_writer(tmp_path):
    """``--approximate_ignore_merges`` is an ExportOptions field (in manifest.json only when set)
    that MnnTarget.prepare hands to the writer: without it Llama-3 is refused naming the flag."""
    from llmexport.cli import export_options, parse_command
    from llmexport.errors import InputError
    from llmexport.targets.mnn_target import MnnTarget

    args = ["--path", str(tmp_path), "--dst_path", str(tmp_path / "out")]
    off, on = (export_options(parse_command(args + extra)) for extra in ([], [APPROXIMATE_FLAG]))
    assert not off.approximate_ignore_merges and on.approximate_ignore_merges
    assert "approximate_ignore_merges" not in off.manifest_fields()
    assert on.manifest_fields()["approximate_ignore_merges"] is True
    checkpoint = SimpleNamespace(path=rebuild("llama-bpe", tmp_path / "tok"), tokenizer_file=lambda: None,
                                 check_tokenizer_side_files=lambda: None)
    arch = SimpleNamespace(end_of_turn_tokens=lambda: ())
    with pytest.raises(InputError, match=APPROXIMATE_FLAG):
        MnnTarget().prepare(checkpoint, arch, off)  # type: ignore[arg-type]
    assert MnnTarget().prepare(checkpoint, arch, on)[:6] == b"430 4\n"  # type: ignore[arg-type]


def test_verify_records_the_approximation(tmp_path):
    """verify.json's tokenizer section: the measured difference, and samples that the runtime
    encodes as HF does without the whole-word lookup are approximated, not mismatches."""
    from llmexport.results import TokenizerCheck
    from llmexport.verification.verify import _tokenizer_check

    folder = rebuild("llama-bpe", tmp_path)
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tj["model"]["ignore_merges"] = False
    merges_only = Tokenizer.from_str(json.dumps(tj))
    word, plain = " Arthropoda", "Hello world"
    cases = {word: (merges_only.encode(word).ids, hf.encode(word).ids), plain: ([1], hf.encode(plain).ids)}
    assert cases[word][0] != cases[word][1]
    check = _tokenizer_check(folder, cases, approximate_ignore_merges=True)
    assert check.mismatches == (plain,) and check.approximated == (word,) and not check.agree
    assert check.ignore_merges is not None and check.ignore_merges["affected_words"] == 588
    assert TokenizerCheck.from_json(json.loads(json.dumps(check.to_json()))) == check
    strict = _tokenizer_check(folder, cases, approximate_ignore_merges=False)
    assert strict.mismatches == (word, plain) and "ignore_merges_approximation" not in strict.to_json()
