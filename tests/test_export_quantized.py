"""Quantized exports: MNN's runtime against the HF model carrying the dequantized weights read
back from the exported files (the only fair oracle); the fp32 error is reported beside it."""

from __future__ import annotations

import json

import pytest
import torch

from llmexport import ExportOptions, export
from llmexport.mnn.embeddings import read_embedding_table, write_embedding_table
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.verification.verify import summary_line, verify_export

VARIANTS = {
    "q8": dict(quant=QuantScheme(8, 64)),
    "q4": dict(quant=QuantScheme(4, 64)),
    "q4-hqq": dict(quant=QuantScheme(4, 64, method=QuantMethod.HQQ)),
    "q4-embed4": dict(quant=QuantScheme(4, 64), embed_bit=4),
    "q4-embed8": dict(quant=QuantScheme(4, 64), embed_bit=8),
    "q4-sym-block32": dict(quant=QuantScheme(4, 32, sym=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("shape", ["e2b", "26b-a4b"])
def test_quantized_export_agrees_with_read_back_oracle(tiny_gemma4, tmp_path, shape, variant):
    out = tmp_path / "out"
    export(tiny_gemma4(shape), out, ExportOptions(**VARIANTS[variant]))
    report = verify_export(out, tiny_gemma4(shape), steps=24)
    print(f"\n{shape} {variant}: {summary_line(report)}")
    for stats in (report.oracle, report.exact_kernels):  # the shipped fast profile, and the exact kernels
        for step in stats.per_step:
            assert not step.flipped, (stats, step)
    assert report.exact_kernels.max_abs_err < 0.2
    assert report.passed


@pytest.mark.slow
def test_quantized_token_table_holds_embedding_and_ple_rows(tiny_gemma4, tmp_path):
    """One table [embedding | PLE] per token (mnn/token_table.py), described as the runtime reads it."""
    out = tmp_path / "out"
    export(tiny_gemma4("e2b"), out, ExportOptions(quant=QuantScheme(4, 64), embed_bit=4))
    llm_config = json.loads((out / "llm_config.json").read_text())
    assert not any(key.startswith("ple_") for key in llm_config)
    assert llm_config["hidden_size"] == 64 + 8 * 16
    tie = llm_config["tie_embeddings"]
    assert (tie["weight_offset"], tie["quant_bit"], tie["quant_block"]) == (0, 4, 64)
    assert json.loads((out / "config.json").read_text())["embedding_file"] == "embeddings_int4.bin"
    assert tie["alpha_offset"] == 512 * 192 // 2 and tie["alpha_size"] == 512 * 3 * 2 * 4
    table = read_embedding_table(out / "embeddings_int4.bin", 512, 192, 4, 64, alpha_bytes=tie["alpha_size"])
    arch = open_architecture(Checkpoint.open(tiny_gemma4("e2b")))
    joined = torch.cat([arch.embedding_table().read().float(), arch.ple_table().read().float()], dim=1)
    expected = tmp_path / "expected.bin"
    with open(expected, "wb") as f:
        write_embedding_table(f, joined, 4, 64)
    assert torch.equal(table, read_embedding_table(expected, 512, 192, 4, 64))
    assert not list(out.glob("ple_*"))


def test_embedding_block_that_does_not_divide_the_table_is_an_error(tiny_gemma4, tmp_path):
    from llmexport.errors import InputError

    # e4b's token table is 64 + 12 layers x 8 = 160 wide: block 64 does not divide it.
    with pytest.raises(InputError, match="embedding table of width 160"):
        export(tiny_gemma4("e4b"), tmp_path / "out", ExportOptions(quant=QuantScheme(4, 64), embed_bit=4))
    assert not (tmp_path / "out").exists()
