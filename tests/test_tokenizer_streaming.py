"""The text MNN 3.6.1's runtime streams token by token, against HF's decode of the same ids.

Per vocabulary (SentencePiece styles of Llama-2 and Phi-3 with their Strip decoder, Gemma's
without it, the GPT-2 / Llama-3 / Qwen ByteLevel styles, and two probes with added tokens that
the runtime's single-id decode would rewrite), one runtime child:
* decodes every id with ``Llm::tokenizer_decode`` (raw bytes), which must equal
  ``StreamModel.piece_bytes`` (llmexport/mnn/tokenizer/stream.py);
* streams scripted answers through ``response()`` (a dummy graph whose logits pick the next id
  of a script by position) with stdout captured, which must equal ``StreamModel.stream_bytes``:
  each generated id's piece, then "\\n" for a stop id.
A hypothesis property test then compares that stream with transformers' decode on random
sequences of each vocabulary's own ids: equal, except for the known differences that
``streamed_text_difference`` classifies (and ``StreamModel.hf_like_text`` predicts exactly).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from llmexport.mnn.tokenizer.byte_level import byte_level_chars
from llmexport.mnn.tokenizer.pieces import hf_piece_bytes, runtime_piece_bytes
from llmexport.mnn.tokenizer.stream import StreamModel, streamed_text_difference
from llmexport.mnn.tokenizer.writer import write_mnn_tokenizer
from llmexport.tiny.byte_level_tokenizer import build_byte_level_tokenizer
from llmexport.tiny.tokenizer import build_tiny_gemma_tokenizer, build_tiny_sentencepiece_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mnn_dummy import run_mnn_script  # noqa: E402

PROMPT = "a"

# Added tokens the runtime's single-id decode would rewrite (the writer respells their rows) or
# cannot be made to stream as HF decodes them ("<0x41>" in a ByteLevel vocabulary: see below).
BYTE_LEVEL_PROBE_TOKENS = [("<｜fim▁hole｜>", True), ("<｜tool▁calls▁begin｜>", True), ("▁lead", False),
                           ("Ġab cd", False), ("x<0x41>y", False), ("<0x41>", False)]
SENTENCEPIECE_PROBE_TOKENS = [("a<0x41>b", False), ("<tool▁call>", True), ("q<0x4", False), ("<0x4A>yz", True)]
UNFIXABLE = {"<0x41>"}  # any row that decodes to exactly "<0xHH>" is turned into that byte by Llm::tokenizer_decode
PROBES = {"probe_byte_level": BYTE_LEVEL_PROBE_TOKENS, "probe_sentencepiece": SENTENCEPIECE_PROBE_TOKENS}

_CHILD = r"""
import ctypes
import numpy as np
import MNN.expr as F
from mnn_dummy import write_dummy_mnn_model

def scripted_graph(path, vocab, script, hidden=4):
    # logits peak at script[max(position_ids)]: the answer after a prompt of P ids is script[P-1:]
    input_ids = F.placeholder([-1, 1, hidden], F.NCHW, F.float); input_ids.name = "input_ids"
    mask = F.placeholder([-1], F.NCHW, F.float); mask.name = "attention_mask"
    position_ids = F.placeholder([1, -1], F.NCHW, F.int); position_ids.name = "position_ids"
    logits_index = F.placeholder([1], F.NCHW, F.int); logits_index.name = "logits_index"
    table = F.const([float(i) for i in script], [len(script)], F.NCHW, F.float)
    target = F.gather(table, F.reshape(F.reduce_max(position_ids), [1]))
    ids = F.const(np.arange(vocab, dtype=np.float32).tolist(), [vocab], F.NCHW, F.float)
    unused = (F.reduce_sum(input_ids) + F.reduce_sum(mask)) * 0.0 + F.cast(F.reduce_sum(logits_index), F.float) * 0.0
    logits = F.reshape(F.negative(F.abs(ids - target)) + unused, [1, 1, vocab])
    logits.name = "logits"
    F.save([logits], str(path))

def raw(fn, *args):
    try:
        return fn(*args).encode("utf-8").hex()
    except UnicodeDecodeError as exc:  # the binding decodes the C string strictly
        return exc.object.hex()

cfg = write_dummy_mnn_model(P["dir"] + "/decode", "../tokenizer.mtok", P["vocab"])
m = L.create(str(cfg))
m.load()
RESULT = {"decode": [raw(m.tokenizer_decode, i) for i in range(P["vocab"])],
          "encode": [m.tokenizer_encode(t) for t in P["texts"]]}
prefix = len(m.tokenizer_encode(P["prompt"])) - 1
libc = ctypes.CDLL(None)
RESULT["streams"] = []
for k, answer in enumerate(P["answers"]):
    cfg = write_dummy_mnn_model(P["dir"] + f"/answer{k}", "../tokenizer.mtok", P["vocab"])
    scripted_graph(Path(cfg).parent / "llm.mnn", P["vocab"], [0] * prefix + answer + [0])
    c = json.loads(Path(cfg).read_text())
    c.update(sampler_type="greedy", use_template=False)
    Path(cfg).write_text(json.dumps(c))
    g = L.create(str(cfg))
    g.load()
    out = Path(P["dir"]) / f"stdout{k}.bin"
    sys.stdout.flush(); libc.fflush(None)
    saved, fd = os.dup(1), os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    g._c_obj.response(P["prompt"], 1, len(answer))  # stream to stdout, at most len(answer) new ids
    libc.fflush(None)
    os.dup2(saved, 1); os.close(fd)
    # (get_context() would crash here: the binding converts generate_str strictly from UTF-8)
    RESULT["streams"].append(out.read_bytes().hex())
"""
_CHILD = "from pathlib import Path\n" + _CHILD


def _stream_of(stdout: bytes, prompt: str, max_new: int) -> bytes:
    """The bytes ``response(..., stream=1)`` wrote between the binding's two log lines."""
    head = f"[MNNLLM] response: text={prompt}, stream=1, max_new_tokens={max_new}\n".encode()
    start = stdout.index(head) + len(head)
    end = stdout.rindex(b"[MNNLLM] response: ")
    return stdout[start:end]


def _add_tokens(folder: Path, tokens: list[tuple[str, bool]]) -> None:
    tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    next_id = max(max(tj["model"]["vocab"].values()), max(t["id"] for t in tj["added_tokens"])) + 1
    for k, (content, special) in enumerate(tokens):
        tj["added_tokens"].append({"id": next_id + k, "content": content, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": special})
    (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")


def _build(name: str, folder: Path) -> None:
    if name in ("llama2", "phi3"):
        build_tiny_sentencepiece_tokenizer(folder, name)
    elif name == "gemma":
        build_tiny_gemma_tokenizer(folder)
    elif name in ("gpt2", "llama3", "qwen"):
        build_byte_level_tokenizer(folder, name)
    elif name == "probe_byte_level":
        build_byte_level_tokenizer(folder, "qwen")
        _add_tokens(folder, PROBES[name])
    elif name == "probe_sentencepiece":
        build_tiny_sentencepiece_tokenizer(folder, "phi3")
        _add_tokens(folder, PROBES[name])
    else:
        raise ValueError(name)


VOCABS = ["llama2", "phi3", "gemma", "gpt2", "llama3", "qwen", "probe_byte_level", "probe_sentencepiece"]
STRIPPING = {"llama2", "phi3", "probe_sentencepiece"}


def _answers(name: str, tok, model: StreamModel) -> list[list[int]]:
    """Scripted answers: a first piece with "▁" (or a leading space), a character split over
    byte ids, a special token that is no stop id, NUL, an unfinished character; a stop id ends
    some of them."""
    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    pieces = model.hf_pieces
    stop = sorted(model.stop_ids)[0]
    if model.byte_level:
        chars = byte_level_chars()
        nul = [pieces.index(chars[0])]
        bytes_of = [pieces.index(chars[b]) for b in "日".encode()]  # one byte character per id
    else:
        nul = [pieces.index("<0x00>")]
        bytes_of = [pieces.index(f"<0x{b:02X}>") for b in "日".encode()]
    streamed_specials = sorted(model.special_ids - model.stop_ids)
    first = "the model" if name in STRIPPING else " the model"  # these normalizers prepend "▁" themselves
    answers = [enc(first) + bytes_of + enc(" ok") + [stop],
               bytes_of[:2] + nul + enc("x") + bytes_of,
               enc("Hello") + bytes_of[:2]]  # cut by max_new_tokens inside a character
    if streamed_specials:
        answers.append(streamed_specials[:3] + enc(" done") + [stop])
    if name in PROBES:
        answers.append(_probe_ids(name, model) + [stop])
    return answers


def _probe_ids(name: str, model: StreamModel) -> list[int]:
    """The ids of the added probe tokens: the last ids of the vocabulary."""
    count = len(PROBES.get(name, ()))
    return list(range(len(model.hf_pieces) - count, len(model.hf_pieces)))


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory):
    built: dict[str, SimpleNamespace] = {}

    def get(name: str) -> SimpleNamespace:
        if name in built:
            return built[name]
        root = tmp_path_factory.mktemp(f"stream-{name}")
        _build(name, root)
        written = write_mnn_tokenizer(root, root / "child" / "tokenizer.mtok")
        tok = AutoTokenizer.from_pretrained(root)
        tj = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
        model = StreamModel.from_tokenizer_json(tj, written.stop_ids, written.pieces)
        answers = _answers(name, tok, model)
        probe_texts = [f"a{model.hf_pieces[i]}b {model.hf_pieces[i]}" for i in _probe_ids(name, model)]
        result = run_mnn_script(_CHILD, {"work_dir": str(root / "child"), "dir": str(root / "child"),
                                         "vocab": len(tok), "prompt": PROMPT, "answers": answers,
                                         "texts": probe_texts}, timeout=300)
        built[name] = SimpleNamespace(name=name, tok=tok, model=model, written=written, answers=answers,
                                      decode=[bytes.fromhex(h) for h in result["decode"]], encode=result["encode"],
                                      texts=probe_texts, streams=result["streams"])
        return built[name]

    return get


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request, vocabs):
    return vocabs(request.param)


def test_single_id_decode_is_the_model(vocab):
    """``Llm::tokenizer_decode`` of every id equals ``StreamModel.piece_bytes`` (the binding returns a
    C string, so a piece decoding to NUL comes back cut there)."""
    model = vocab.model
    assert len(vocab.decode) == len(model.pieces) == len(vocab.tok)
    cut = 0
    for i, got in enumerate(vocab.decode):
        want = model.piece_bytes(i)
        if b"\0" in want:
            cut += 1
            want = want.split(b"\0")[0]
        assert got == want, (i, model.pieces[i], got, want)
    assert cut == 1  # <0x00> (or the byte character of 0): streamed as NUL, see test_response_streams_the_pieces


def test_response_streams_the_pieces(vocab):
    """``response()`` writes each generated id's single-id decode, nothing else: no state, no strip
    of the first piece, special tokens as text, raw bytes of a character split over ids (even an
    unfinished one), and "\\n" instead of a stop id."""
    assert len(vocab.streams) >= 3
    for answer, got in zip(vocab.answers, vocab.streams):
        kept = vocab.model.streamed_ids(answer)
        stream = _stream_of(bytes.fromhex(got), PROMPT, len(answer))
        assert stream == vocab.model.stream_bytes(answer)
        nul = [i for i in range(len(vocab.decode)) if vocab.model.piece_bytes(i) == b"\0"]
        per_id = [b"\0" if i in nul else vocab.decode[i] for i in kept]  # the runtime's own single-id decodes
        assert stream == b"".join(per_id) + (b"\n" if len(kept) < len(answer) else b"")


def test_first_piece_space(vocab):
    """The measured difference: with HF's Strip decoder (Llama-2, Phi-3) the stream starts with the
    space HF's decode drops; without it (Gemma, ByteLevel styles) the stream is HF's text."""
    answer = vocab.answers[0]
    kept = vocab.model.streamed_ids(answer)
    stream = _stream_of(bytes.fromhex(vocab.streams[0]), PROMPT, len(answer))
    text = stream.decode("utf-8")
    hf = vocab.tok.decode(kept, skip_special_tokens=False)
    assert text.endswith("\n") and text[:-1].startswith(" the model")
    if vocab.name in STRIPPING:
        assert text[:-1] == " " + hf and hf.startswith("the model")
        dif = streamed_text_difference(vocab.model, answer, stream[:-1], hf)
        assert dif is not None and dif.kinds == ("leading_strip",) and dif.index == 0
    else:
        assert text[:-1] == hf
        assert streamed_text_difference(vocab.model, answer, stream[:-1], hf) is None


def _pool(model: StreamModel) -> dict[str, list[int]]:
    pieces = model.hf_pieces
    return {
        "any": list(range(len(pieces))),
        "bytes": [i for i, p in enumerate(pieces) if len(p) == 6 and p.startswith("<0x")]
        or [i for i, p in enumerate(pieces) if len(p) == 1 and ord(p) >= 0x80],
        "space": [i for i, p in enumerate(pieces) if p.startswith(("\u2581", "Ġ", " ")) or p == "<0x20>"],
        "special": sorted(model.special_ids),
    }


@pytest.mark.parametrize("name", VOCABS)
def test_stream_matches_hf_decode_property(vocabs, name):
    """Random sequences of the vocabulary's own ids: the runtime's stream (its measured single-id
    decodes, concatenated: see the tests above) against transformers' decode."""
    v = vocabs(name)
    model, tok = v.model, v.tok
    pool = _pool(model)
    measured = [model.piece_bytes(i) if b"\0" in model.piece_bytes(i) else v.decode[i] for i in range(len(v.decode))]
    seen: dict[tuple[bool, tuple[str, ...]], int] = {}

    ids_strategy = st.lists(st.one_of(*(st.sampled_from(pool[k]) for k in ("any", "bytes", "space", "special")
                                        if pool[k])), min_size=1, max_size=14)

    @settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(ids=ids_strategy)
    def check(ids):
        kept = model.streamed_ids(ids)
        stream = b"".join(measured[i] for i in kept)
        assert stream + (b"\n" if len(kept) < len(ids) else b"") == model.stream_bytes(ids)
        for skip in (False, True):
            hf = tok.decode(kept, skip_special_tokens=skip)
            assert model.hf_like_text(ids, skip_special_tokens=skip) == hf, (ids, skip)
            dif = streamed_text_difference(model, ids, stream, hf, skip_special_tokens=skip)
            kinds = dif.kinds if dif else ()
            seen[(skip, kinds)] = seen.get((skip, kinds), 0) + 1
            assert "unexplained" not in kinds, (ids, stream, hf, dif)
            valid = _valid(stream)
            if valid and not (skip and set(kept) & model.special_ids) and not set(kept) & set(model.piece_text_ids()):
                text = stream.decode("utf-8")
                if name in STRIPPING:  # HF drops one leading space, nothing else differs
                    assert hf == (text[1:] if text.startswith(" ") else text)
                else:
                    assert hf == text and dif is None

    check()
    kinds_seen = {k for _, kinds in seen for k in kinds}
    assert "invalid_utf8" in kinds_seen and (name not in STRIPPING or "leading_strip" in kinds_seen)
    assert (False, ()) in seen  # plenty of sequences stream exactly HF's text
    assert not {"unexplained"} & kinds_seen
    if model.special_ids - model.stop_ids:
        assert "special_tokens" in kinds_seen


def _valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("name", ["probe_byte_level", "probe_sentencepiece"])
def test_added_tokens_are_respelled_to_stream_as_hf_decodes(vocabs, name):
    """Added tokens with "▁" or "<0x.." inside (and, for ByteLevel, byte characters next to
    characters outside the byte map) would stream differently from HF's decode of them; the writer
    respells their vocabulary rows, and the runtime then streams exactly HF's text. Encoding is
    unchanged: the runtime matches added tokens by their content."""
    v = vocabs(name)
    model, tok = v.model, v.tok
    fixed = 0
    for idx, (content, _) in zip(_probe_ids(name, model), PROBES[name]):
        assert model.hf_pieces[idx] == content
        hf = tok.decode([idx], skip_special_tokens=False).encode("utf-8")
        assert hf == hf_piece_bytes(content, model.decoder)
        got = v.decode[idx]
        if content in UNFIXABLE:
            assert got != hf and idx in model.piece_text_ids() and model.pieces[idx] == content
            continue
        assert got == hf, content
        if runtime_piece_bytes(content, byte_level=model.byte_level) != got:
            assert model.pieces[idx] != content
            fixed += 1
    assert fixed == (5 if name == "probe_byte_level" else 2)
    assert v.texts and v.encode == [tok(t, add_special_tokens=False)["input_ids"] for t in v.texts]


def test_streamed_text_difference_flags_a_wrong_stream(vocabs):
    """A stream that is not the runtime's decode of the ids, or HF text no known difference
    explains, is reported as unexplained."""
    v = vocabs("llama2")
    ids = v.tok("the model", add_special_tokens=False)["input_ids"]
    stream = v.model.stream_bytes(ids)
    hf = v.tok.decode(ids)
    assert streamed_text_difference(v.model, ids, stream, hf).kinds == ("leading_strip",)
    assert streamed_text_difference(v.model, ids, stream + b"!", hf).kinds == ("unexplained",)
    assert streamed_text_difference(v.model, ids, stream, hf + "!").kinds == ("unexplained",)
    rng = random.Random(0)
    ids = [rng.randrange(len(v.model.pieces)) for _ in range(50)]
    kept = v.model.streamed_ids(ids)
    stream = b"".join(v.model.piece_bytes(i) for i in kept)
    dif = streamed_text_difference(v.model, ids, stream, v.tok.decode(kept))
    assert dif is None or dif.explained
