"""Stage 3 parity: the exported folder run by MNN's runtime vs the HF model carrying exactly the
weights the export stored (read back from the files). Errors against fp32 HF are reported only."""

from __future__ import annotations

import json

import pytest

from llmexport import ExportOptions, export
from llmexport.mnn.config import RuntimeProfile
from llmexport.quant.scheme import QuantScheme
from llmexport.verification.verify import summary_line, verify_export

from conftest import GEMMA4_SHAPES
from families import parametrize

RUNTIME_FILES = {"config.json", "llm_config.json", "llm.mnn", "llm.mnn.weight", "tokenizer.mtok"}


@pytest.fixture(scope="module")
def exported(tiny_gemma4, tmp_path_factory):
    cache = {}

    def get(shape: str, bits: int):
        if (shape, bits) not in cache:
            out = tmp_path_factory.mktemp(f"export-{shape}-{bits}") / "out"
            result = export(tiny_gemma4(shape), out, ExportOptions(quant=QuantScheme(bits, 64)))
            cache[shape, bits] = (out, result, verify_export(out, tiny_gemma4(shape), steps=24))
        return cache[shape, bits]

    return get


@pytest.mark.slow
@parametrize("mnn", "shape", GEMMA4_SHAPES, "gemma4")
def test_fp16_export_agrees_with_stored_weights_oracle(exported, shape):
    out, result, report = exported(shape, 16)
    print(f"\n{shape} q16 export {sum(result.timings.values()):.2f}s: {summary_line(report)}")
    oracle = report.oracle
    assert report.prompt_tokens > 8  # longer than the sliding window
    assert oracle.greedy_ref == oracle.greedy_mnn and len(oracle.greedy_mnn) == 24
    assert oracle.top1_agreement == 1.0
    assert oracle.max_abs_err < 0.005
    assert report.tokenizer.agree
    assert report.passed
    assert len(report.fp32.per_step) == 24  # reported, not bounded


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["e2b", "26b-a4b"])
def test_4bit_export_agrees_with_read_back_weights(exported, shape):
    out, result, report = exported(shape, 4)
    print(f"\n{shape} q4 export {sum(result.timings.values()):.2f}s: {summary_line(report)}")
    assert report.passed, report.failures
    # shipped: the fast profile; the exact kernels prove the graph and the records
    assert report.runtime_profile is RuntimeProfile.FAST and report.exact_kernels.max_abs_err < 0.2


@pytest.mark.slow
def test_export_folder_holds_what_the_runtime_reads(exported):
    out, result, _ = exported("e2b", 16)
    names = {p.name for p in out.iterdir()}
    assert RUNTIME_FILES | {"embeddings_bf16.bin"} <= names
    assert not any(name.startswith((".", "ple_")) for name in names)  # no staging leftovers, no PLE file
    llm_config = json.loads((out / "llm_config.json").read_text())
    assert llm_config["attention_type"] == "mix" and llm_config["sliding_window"] == 8
    assert llm_config["attn_scale"] == 1.0
    # the token table's rows are [embedding 64 | PLE 8 x 16], bf16; the tied lm_head keeps its record
    assert llm_config["hidden_size"] == 64 + 8 * 16 and not any(key.startswith("ple_") for key in llm_config)
    assert "tie_embeddings" not in llm_config and (out / "embeddings_bf16.bin").stat().st_size == 512 * 192 * 2
    config = json.loads((out / "config.json").read_text())
    assert config["precision"] == "normal" and config["embedding_file"] == "embeddings_bf16.bin"


@pytest.mark.slow
def test_untied_export_writes_its_embedding_file(exported):
    out, _, report = exported("31b", 16)
    config = json.loads((out / "config.json").read_text())
    assert config["embedding_file"] == "embeddings_bf16.bin"
    assert (out / "embeddings_bf16.bin").stat().st_size == 512 * 64 * 2
    assert "tie_embeddings" not in json.loads((out / "llm_config.json").read_text())
    assert report.passed


@pytest.mark.slow
def test_media_token_ids_in_plain_text_reach_the_text_graph_as_themselves(exported, tiny_gemma4):
    """Stray media-token ids (image 9, audio 12) in a text prompt: runtime and text oracle agree."""
    out, _, _ = exported("e2b", 16)
    prompt = [2, 5, 30, 9, 9, 41, 12, 77, 6, 5] + list(range(100, 110))
    report = verify_export(out, tiny_gemma4("e2b"), steps=8, prompt_ids=prompt)
    assert report.passed, report.failures


@pytest.mark.slow
def test_hidden_wider_than_1024_keeps_its_norm_constants(tmp_path):
    """MNN's converter moves constants of more than 1024 elements (norm gammas at real hidden
    sizes) into its external file; the rebuilt weight file must carry them."""
    from llmexport.tiny.gemma4 import SHAPES, build_gemma4_checkpoint, text_config_dict

    config = text_config_dict(SHAPES["e2b"])
    config.update(hidden_size=1152, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=64, global_head_dim=128, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention", "full_attention"],
                  num_hidden_layers=4, num_kv_shared_layers=2, hidden_size_per_layer_input=8)
    path = build_gemma4_checkpoint(tmp_path / "wide", config)
    export(path, tmp_path / "out", ExportOptions(quant=QuantScheme(16)))
    report = verify_export(tmp_path / "out", path, steps=8)
    print(f"\nhidden 1152 q16: {summary_line(report)}")
    assert report.passed, report.failures
    assert report.oracle.max_abs_err < 0.005
