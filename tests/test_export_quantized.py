"""Quantized exports: MNN's runtime against the HF model carrying the dequantized weights read
back from the exported files (the only fair oracle); the fp32 error is reported beside it."""

from __future__ import annotations

import json

import pytest

from llmexport import ExportOptions, export
from llmexport.mnn.embeddings import read_embedding_table
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.verification import summary_line, verify_export

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
            assert step.top1_match or step.ref_top2_margin < step.max_abs_err, (stats, step)
    assert report.exact_kernels.max_abs_err < 0.2
    assert report.passed


@pytest.mark.slow
def test_quantized_ple_table_is_described_and_readable(tiny_gemma4, tmp_path):
    out = tmp_path / "out"
    export(tiny_gemma4("e2b"), out, ExportOptions(quant=QuantScheme(4, 64), embed_bit=4))
    llm_config = json.loads((out / "llm_config.json").read_text())
    offset, alpha_offset, alpha_bytes, bits, block = llm_config["ple_quant"]
    assert (offset, bits, block) == (0, 4, 64) and llm_config["ple_embed_file"] == "ple_embeddings_int4.bin"
    table = read_embedding_table(out / "ple_embeddings_int4.bin", 512, 128, 4, 64, alpha_bytes=alpha_bytes)
    assert alpha_offset == 512 * 128 // 2 and table.shape == (512, 128)


def test_embedding_block_that_does_not_divide_the_table_is_an_error(tiny_gemma4, tmp_path):
    from llmexport.errors import InputError

    # e4b's PLE table is 12 layers x 8 = 96 wide: block 64 does not divide it.
    with pytest.raises(InputError, match="PLE table of width 96"):
        export(tiny_gemma4("e4b"), tmp_path / "out", ExportOptions(quant=QuantScheme(4, 64), embed_bit=4))
    assert not (tmp_path / "out").exists()
