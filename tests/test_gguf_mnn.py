"""GGUF files made by llama.cpp's tools, exported to MNN with ``--verify`` (one session-scoped export
per file): every kept record holds llama.cpp's integers and reads back to exactly gguf-py's
dequantized values, and MNN's runtime matches the HF model carrying the stored weights, the
conversation check included."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf_fixtures import OUR_MIX, gguf_views, has_llama_cpp

from llmexport.api import export
from llmexport.mnn.readback import linear_records
from llmexport.mnn.weight_reader import read_levels, read_linear
from llmexport.options import ExportOptions
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.hub import resolve_source
from llmexport.source.loading import open_architecture


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory):
    yield from gguf_views(tmp_path_factory)


#: case -> (family, GGUF type): symmetric 8-bit blocks of Qwen3 (q/k norms, head_dim from key_length) by
#: convert_hf_to_gguf.py; the trained Llama (llama.cpp's q/k permutation, llama3 RoPE from rope_freqs)
#: as a Q4_K_M-like mix by our packers: Q4_K kept as asymmetric records, Q6_K as symmetric 8-bit records of
#: block 16; a Mistral
#: (written by convert_hf_to_gguf.py as arch llama, q/k permuted) and a Qwen3-MoE (stacked experts
#: split into per-expert records), a Phi-3 (fused qkv / gate_up kept as one record each, partial rotary
#: and longrope read from the file), an LFM2 (short-conv layers: the F32 conv kernels as stored, in/out
#: projections kept), an LFM2-MoE (its stacked experts split, the sigmoid router's F32 selection bias),
#: a Gemma3 (norms' +1 taken off, sliding pattern, attention scale and local RoPE base as llama.cpp
#: derives them, tied Q8_0 token table), a Gemma4 (E2B-style: PLE, KV sharing) and a Gemma4 26B-A4B-style
#: (its stacked experts kept per expert, the dense MLP beside them, K=V full layers), all by convert_hf_to_gguf.py;
#: (family, type, tiny variant) where it is not the family's own
CASES: dict[str, tuple[str, ...]] = {"qwen3-q8_0": ("qwen3", "q8_0"), "trained-llama-mix": ("trained", OUR_MIX),
         "mistral-q8_0": ("mistral", "q8_0"), "qwen3-moe-q8_0": ("qwen3_moe", "q8_0"),
         "phi3-q8_0": ("phi3", "q8_0"), "lfm2-q8_0": ("lfm2", "q8_0"), "lfm2-moe-q8_0": ("lfm2_moe", "q8_0"),
         "gemma3-q8_0": ("gemma3", "q8_0"), "gemma4-q8_0": ("gemma4", "q8_0"),
         "gemma4-26b-a4b-q8_0": ("gemma4", "q8_0", "gemma4-26b-a4b")}
#: the routers' names end so (Qwen3-MoE's and LFM2-MoE's ``gate``, Gemma4's ``router.proj``): F32 in
#: llama.cpp's files
ROUTERS = (".gate", ".router.proj")


@pytest.fixture(scope="session")
def exported(ggufs, tmp_path_factory):
    done = {}

    def get(case: str):
        if case not in done:
            family, qtype, *variant = CASES[case]
            path, hf = ggufs.trained(qtype) if family == "trained" else ggufs(family, qtype, *variant)
            result = export(path, tmp_path_factory.mktemp(case) / "out", ExportOptions(verify=True))
            done[case] = (path, hf, result)
        return done[case]

    return get


def _check_records(path, out, result) -> int:
    """Every transcoded record holds the file's integers and decodes to gguf-py's values exactly."""
    arch = open_architecture(Checkpoint.open(resolve_source(path).folder))
    weights = arch.checkpoint.weights
    kept = {linear.name for linear in result.plan.linears if linear.method is QuantMethod.STORED}
    checked = 0
    for name, rec in linear_records(out).items():
        if name not in kept:
            continue
        where = arch.linear_source(name)  # an expert of a stacked tensor (Gemma4's): its slice
        source = weights.prequantized(where.weight, where.expert)
        levels, _ = read_levels(out / "llm.mnn.weight", rec["external"], rec["quanParameter"], rec["oc"], rec["ic"])
        assert np.array_equal(levels + (1 << (source.bits - 1)), source.levels.numpy()), name
        decoded, _ = read_linear(out / "llm.mnn.weight", rec["external"], rec["quanParameter"], rec["oc"], rec["ic"])
        values = weights.tensor(where.weight)
        assert torch.equal(decoded, values if where.expert is None else values[where.expert]), name
        checked += 1
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_export_keeps_the_integers_and_verifies(exported, case):
    path, hf, result = exported(case)
    report = result.verification
    assert result.verify_error is None and report is not None and report.passed, result.verify_error
    pre = result.plan.prequantized
    # routers (ffn_gate_inp) are F32 in llama.cpp's files, and so are Gemma4's per_layer_projection (16 inputs:
    # no whole Q8_0 block): quantized from float, by the options
    assert pre is not None and all(e.name.endswith(ROUTERS + (".per_layer_projection",))
                                   for e in pre.quantized_from_float)
    assert pre.transcoded == len(result.plan.linears) - len(pre.requantized) - len(pre.quantized_from_float) > 0
    assert not pre.requantized
    # the routers of MNN's MoE op are stored in float: their F32 values read back exactly too (Gemma4's
    # router, a linear of its graph, is quantized by the options, as from an HF checkpoint)
    routers = [e for e in pre.quantized_from_float if e.name.endswith(".gate")]  # mlp. or feed_forward.
    assert report.prequantized["linears_exact"] == pre.transcoded + len(routers)
    floats = {e.name for e in pre.quantized_from_float} - {e.name for e in routers}  # quantized by the options
    assert set(report.prequantized["linears_changed"]) == {e.name for e in pre.requantized} | floats
    for name, table in pre.tables.items():  # an untied table kept as stored reads back exactly
        assert report.prequantized["tables"][name]["exact"] == table.kept
    assert _check_records(path, result.dst, result) == pre.transcoded
    assert report.exact_kernels is not None and report.exact_kernels.max_abs_err < 1e-3
    assert report.conversation is not None and len(report.conversation.turns) == report.conversation.planned_turns
    # not vacuous: the records hold llama.cpp's rounding, not the checkpoint's floats
    records = linear_records(result.dst)
    probe = next(n for n in ("model.layers.1.mlp.up_proj", "model.layers.1.mlp.experts.0.up_proj",
                             "model.layers.1.mlp.gate_up_proj", "model.layers.1.feed_forward.w3",
                             "model.layers.1.feed_forward.experts.0.w3") if n in records)
    source = Checkpoint.open(hf).weights.tensor(f"{probe}.weight").float()
    rec = records[probe]
    decoded, _ = read_linear(result.dst / "llm.mnn.weight", rec["external"], rec["quanParameter"], rec["oc"], rec["ic"])
    assert 0 < float((decoded - source).abs().max()) < 0.1
    manifest = json.loads((result.dst / "manifest.json").read_text())
    assert manifest["prequantized"]["format"] == "gguf" and manifest["prequantized"]["transcoded"] == pre.transcoded


def llama_cpp_greedy(path, prompt: list[int], steps: int) -> list[int]:
    """llama.cpp's own greedy continuation of ``prompt`` on the GGUF file (llama-cpp-python)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    out = []
    llm.eval(prompt)
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


@pytest.mark.slow
@pytest.mark.skipif(not has_llama_cpp(), reason="llama-cpp-python (llama.cpp's quantizer, runtime) is not installed")
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q3_K_M", "Q2_K", "Q5_K_M", "Q6_K", "IQ4_NL"])
def test_llama_cpp_k_quant_file_exports_and_gives_llama_cpps_greedy_answer(ggufs, tmp_path, ftype):
    """llama.cpp's own files (``llama_model_quantize``) of the trained tiny Llama: every linear of
    the K-quant files keeps its integers (Q2_K to Q6_K: Q6_K for the tied token_embd / lm_head and
    some attn_v and ffn_down), --verify passes, and MNN's greedy answer is llama.cpp's. IQ4_NL's
    codebook levels have no record: those linears are re-quantized, with the reason, at 8 bits
    (block 32), so that the answer is still llama.cpp's model."""
    from transformers import AutoTokenizer

    from llmexport.mnn.runtime import run_runtime

    path, _ = ggufs.trained(ftype)
    codebook = ftype.startswith("IQ")
    options = ExportOptions(verify=True, quant=QuantScheme(8, 32) if codebook else QuantScheme(4, 64))
    result = export(path, tmp_path / "out", options)
    report, pre = result.verification, result.plan.prequantized
    assert report is not None and report.passed and pre is not None and pre.transcoded > 0
    assert {e.stored for e in pre.requantized} == ({ftype} if codebook else set())
    assert all("codebook" in e.reason for e in pre.requantized)
    assert report.prequantized["linears_exact"] == pre.transcoded
    assert _check_records(path, result.dst, result) == pre.transcoded
    tokenizer = AutoTokenizer.from_pretrained(resolve_source(path).folder)
    prompt = tokenizer("It is a truth universally acknowledged, that a single man")["input_ids"]
    ours = run_runtime(result.dst, prompt, None, 12).greedy_ids
    assert ours == llama_cpp_greedy(path, prompt, 12)
