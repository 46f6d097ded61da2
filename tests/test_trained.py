"""llmexport/tiny/trained.py and its text sources: deterministic, loss goes down, cached, bad input
refused in one line. Small shapes and a self-written text: no network, seconds."""

from __future__ import annotations

import io
import math
import tarfile
from dataclasses import replace

import pytest

from llmexport.tiny import trained
from llmexport.tiny.corpus import AUSTEN_BOOKS, Corpus, CorpusError, austen_books, corpus_from_file, paragraphs
from llmexport.tiny.rdata import RDataError, read_character_vector, read_rdb_records, write_rdb_record

# Self-written prose (no source text copied), varied enough for a tokenizer to learn merges.
TEXT = """\
The morning was grey and the road to the village ran wet between the hedges. Anne walked
slowly, for she had no wish to arrive before the others, and the letter in her pocket felt
heavier with every step.

At the gate she stopped. Her brother was standing by the window of the little house, reading,
and he did not look up. She thought of the many times she had waited there as a child, and of
how patient everyone had been with her then.

"You are early," said her aunt, opening the door before she could knock. "Come in, and tell me
everything. Is it true that the captain has returned? They say he has a fortune now, and a
great deal of good sense besides."

Anne smiled and said that she did not know, which was true, and that she hoped he was well,
which was also true. Her aunt looked at her for a long moment and then poured the tea.

The afternoon passed in talk of neighbours, of the harvest, of a wedding in the spring. When
the light began to fail, Anne rose to leave, and her aunt pressed her hand and said nothing.
"""

SMALL = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
GEMMA_SMALL = dict(SMALL, global_head_dim=32, hidden_size_per_layer_input=8, sliding_window=8)
RECIPES = {
    "llama": trained.TrainRecipe("test-llama", "llama", vocab_size=320, seq_len=24, batch_size=4, steps=30,
                                 lr=1e-2, warmup=3, eval_windows=2,
                                 config=tuple(dict(SMALL, num_hidden_layers=2).items())),
    "gemma4": trained.TrainRecipe("test-gemma4", "gemma4", vocab_size=384, seq_len=24, batch_size=4, steps=30,
                                  lr=1e-2, warmup=3, eval_windows=2, config=tuple(GEMMA_SMALL.items())),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT * 3, encoding="utf-8")
    return corpus_from_file(path, heldout_fraction=0.2)


@pytest.mark.parametrize("family", sorted(RECIPES))
def test_training_lowers_the_loss(family, corpus, tmp_path):
    result = trained.train(RECIPES[family], corpus, tmp_path / "ckpt")
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 1.0, result.losses
    assert result.heldout_ppl < math.exp(first) / 2  # well below the untrained model's
    assert (tmp_path / "ckpt" / "training.json").is_file() and (tmp_path / "ckpt" / "tokenizer.json").is_file()


def test_training_is_deterministic(corpus, tmp_path):
    recipe = replace(RECIPES["llama"], steps=4)
    a = trained.train(recipe, corpus, tmp_path / "a")
    b = trained.train(recipe, corpus, tmp_path / "b")
    assert a.losses == b.losses
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_trained_checkpoint_is_cached(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv(trained.CACHE_ENV, str(tmp_path / "cache"))
    recipe = replace(RECIPES["llama"], steps=2)
    path = trained.trained_checkpoint(recipe, corpus)
    assert path.parent == tmp_path / "cache" and path.name == trained.recipe_key(recipe, corpus)

    def fail(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(trained, "train", fail)
    assert trained.trained_checkpoint(recipe, corpus) == path
    assert trained.recipe_key(replace(recipe, seed=1), corpus) != path.name


def test_bad_text_gets_one_line_errors(tmp_path):
    with pytest.raises(CorpusError, match=r"no such text file"):
        corpus_from_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(CorpusError, match=r"no text in it"):
        corpus_from_file(tmp_path / "empty.txt")
    (tmp_path / "one.txt").write_text("just one paragraph\nof two lines\n")
    with pytest.raises(CorpusError, match=r"at least two paragraphs"):
        corpus_from_file(tmp_path / "one.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(CorpusError, match=r"cannot read it as UTF-8") as info:
        corpus_from_file(tmp_path / "bin.txt")
    assert "\n" not in str(info.value)
    with pytest.raises(SystemExit, match=r"^error: .*no such text file"):
        trained.main(["llama", "--text", str(tmp_path / "missing.txt")])


def test_paragraphs_join_wrapped_lines():
    assert paragraphs(["One", "two.", "", None, "", "Three"]) == "One two.\nThree"


def test_rdata_records_round_trip():
    books = [["EMMA", "", "line one", "line two"], ["PERSUASION", "x"]]
    records = read_rdb_records(b"".join(write_rdb_record(b) for b in books))
    assert [read_character_vector(r) for r in records] == books
    with pytest.raises(RDataError):
        read_character_vector(b"A\nnot R")
    with pytest.raises(RDataError):
        read_rdb_records(write_rdb_record(["x"])[:-3])


def _deb(files: dict[str, bytes]) -> bytes:
    """A .deb as dpkg builds one: an ar archive with debian-binary and a data tarball."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        for name, body in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    out = b"!<arch>\n"
    for name, body in (("debian-binary", b"2.0\n"), ("data.tar.xz", data.getvalue())):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode() + body
        out += b"\n" if len(body) % 2 else b""
    return out


def test_austen_books_read_from_a_deb():
    records = [write_rdb_record([title.title(), "", f"Text of {title.lower()},", "wrapped."])
               for title in AUSTEN_BOOKS]
    member = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
    books = austen_books(_deb({member: b"".join(records)}))
    assert sorted(books) == sorted(AUSTEN_BOOKS)
    assert books["PERSUASION"] == "Persuasion\nText of persuasion, wrapped."
    with pytest.raises(CorpusError, match="expected the books"):
        austen_books(_deb({member: b"".join(records[:-1])}))
    with pytest.raises(CorpusError, match="cannot read its data"):
        austen_books(_deb({member: b"".join(records)[:-5]}))
    with pytest.raises(CorpusError, match="no usr/lib"):
        austen_books(_deb({"other": b"x"}))


def test_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="unknown trained model"):
        trained.trained_checkpoint("nope", Corpus("a", "b", "test"))
    with pytest.raises(ValueError, match="unknown family"):
        trained.TrainRecipe("x", "gpt")



@pytest.mark.slow
def test_quality_of_an_fp16_export_in_mnn(corpus, tmp_path):
    """End to end on a small trained model: exported at 16 bits, MNN's runtime (a fresh instance per
    window, token by token) scores held-out windows as HF fp32 does."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import llmexport
    from llmexport.mnn.runtime import run_windows
    from llmexport.quant.scheme import QuantScheme
    from llmexport.verification.quality import compare, windows

    checkpoint = trained.train(replace(RECIPES["llama"], steps=10), corpus, tmp_path / "ckpt").path
    wins = windows(trained.encode(checkpoint, corpus.heldout), 12, 2, trained.bos_id(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = np.concatenate([model(torch.tensor([w])).logits[0, :-1].numpy() for w in wins])
    llmexport.export(checkpoint, tmp_path / "mnn", llmexport.ExportOptions(quant=QuantScheme(bits=16), quiet=True))
    mnn = np.concatenate(run_windows(tmp_path / "mnn", wins))
    stats = compare(ref, mnn, np.concatenate([w[1:] for w in wins]))
    assert stats.positions == 22 and stats.top1 == 1.0
    assert stats.kld_mean < 1e-5 and abs(stats.delta_ppl) < 1e-3 * stats.ppl_ref
