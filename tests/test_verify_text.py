"""``--verify_text``: the runtime against HF fp32 on windows of the user's text, with llama.cpp's
definitions (perplexity, KLD, top-1), and KLD on the verification's own steps (llmexport/verification/verify.py)."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from llmexport.api import export
from llmexport.cli import main
from llmexport.options import ExportOptions, VerifyText
from llmexport.quant.scheme import QuantScheme
from llmexport.results import VerifyReport
from llmexport.tiny.byte_level_tokenizer import EXTRA_CORPUS
from llmexport.tiny.tokenizer import TRAINING_CORPUS
from llmexport.verification.quality import windows
from llmexport.verification.verify import verify_export


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "held-out.txt"
    path.write_text(TRAINING_CORPUS + EXTRA_CORPUS, encoding="utf-8")
    return path


def _hf_perplexity(path, text_file, count: int, length: int) -> float:
    """The same windows scored by transformers' own model, in one forward each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"]
    nll = []
    with torch.no_grad():
        for window in windows(ids, length, count, tokenizer.bos_token_id):
            logits = model(torch.tensor([window])).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="none"))
    return math.exp(torch.cat(nll).double().mean().item())


@pytest.mark.parametrize("bits", [16, 4])
def test_verify_text_reports_llama_cpp_numbers(tiny_decoder, tmp_path, text_file, bits):
    path, out = tiny_decoder("llama3"), tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(bits, 64)))
    report = verify_export(out, path, steps=8, text=VerifyText(text_file, windows=3, length=64))
    name, stats = report.text_quality
    assert name == str(text_file) and stats.positions == 3 * 63
    assert stats.ppl_ref == pytest.approx(_hf_perplexity(path, text_file, 3, 64), rel=1e-5)
    assert report.fp32_quality is not None and report.fp32_quality.positions == 8
    if bits == 16:  # the runtime's fp16 weights: next to nothing lost
        assert stats.kld_mean < 1e-3 and stats.top1 > 0.97 and abs(stats.delta_ppl) < 0.01 * stats.ppl_ref
    else:
        assert stats.kld_mean > 1e-3  # 4-bit rounding of a random model is visible
    assert VerifyReport.read(out / "verify.json") == report


def test_verify_text_needs_verify_and_a_readable_file(tiny_decoder, tmp_path, text_file):
    path = str(tiny_decoder("llama3"))
    result = CliRunner().invoke(main, ["--path", path, "--dst_path", str(tmp_path / "a"), "--verify_text",
                                       str(text_file)])
    assert result.exit_code != 0 and "needs --verify" in result.output and not (tmp_path / "a").exists()
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\0\1\2")
    result = CliRunner().invoke(main, ["--path", path, "--dst_path", str(tmp_path / "b"), "--verify",
                                       "--verify_text", str(binary)])
    assert result.exit_code == 3 and f"--verify_text {binary}: binary" in result.output
    assert not (tmp_path / "b").exists()
