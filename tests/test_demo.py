"""make demo (llmexport/demo.py): the trained model, its export and the two continuations."""

from __future__ import annotations

import pytest

from llmexport import demo
from llmexport.tiny.corpus import corpus_from_file


def test_first_difference():
    assert demo.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert demo.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert demo.first_difference([1, 2], [1, 2, 3]) == 2
    assert demo.first_difference([], []) is None


def test_the_builtin_text_is_a_corpus():
    corpus = corpus_from_file(demo.BUILTIN_TEXT)
    assert corpus.train.startswith("Chapter 1\nIt is a truth universally acknowledged")
    assert demo.PROMPT in corpus.train  # the demo continues a sentence the model was trained on
    assert len(corpus.heldout) > 1000


def test_the_export_command_is_the_users(tmp_path):
    command = demo.export_command(tmp_path / "ckpt", tmp_path / "out")
    assert command[:5] == ["llmexport", "--path", str(tmp_path / "ckpt"), "--dst_path", str(tmp_path / "out")]
    assert "--verify" in command and str(demo.BUILTIN_TEXT) in command


@pytest.mark.slow
def test_the_demo_shows_the_same_sentence_from_hf_and_mnn(tmp_path, capfd):
    """The demo as `make demo` runs it: the export passes --verify and both sides continue the
    book's sentence with the same tokens. Its model comes from the shared trained cache, as a second
    `make demo` gets it (trained on the first run: the cache key holds the recipe, the text and the
    trainer's version; tests/test_trained.py covers training, its determinism and the cache)."""
    code = demo.run_demo(tmp_path / "out")
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "verify: PASS" in out
    verify = next(line for line in out.splitlines() if line.startswith("verify: "))
    assert "top-1 9" in verify.split("pride_and_prejudice_1-6.txt vs fp32 HF:")[1]  # >= 90% on the text it knows
    hf = next(line for line in out.splitlines() if line.startswith("HF (fp32):"))
    mnn = next(line for line in out.splitlines() if line.startswith("MNN export (4-bit):"))
    assert hf.split(":", 1)[1].strip() == mnn.split(":", 1)[1].strip()
    assert "Netherfield" in hf  # the model learned the book: chapter 1's next sentence
    assert f"the same {demo.NEW_TOKENS} tokens from both" in out
