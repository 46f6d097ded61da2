"""The decoder's q/k norms + RoPE as MNN's ``RoPE`` op, and the C4 graph the converter builds around it
(docs/benchmarks.md, "Against MNN's own exporter")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from llmexport.errors import ConversionError
from llmexport.mnn.convert import mnn_to_json
from llmexport.mnn.rebuild import _rope_op
from llmexport.models.rope import rope_cos_sin
from llmexport.trace.ops import FusedRoPE

HEADS, KV_HEADS, DIM, SEQ = 4, 2, 16, 5


def _hf(q, k, cos, sin, q_norm, k_norm):
    """transformers' Qwen3 attention: per-head RMSNorm, then apply_rotary_pos_emb on [b, heads, seq, dim]."""
    q, k = q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos[:, :, 0], sin[:, :, 0])
    return q.transpose(1, 2), k.transpose(1, 2)


def _norm(weight):
    norm = Qwen3RMSNorm(DIM, eps=1e-6)
    norm.weight.data = weight
    return norm


def test_eager_rope_matches_transformers_qwen3():
    torch.manual_seed(0)
    q, k = torch.randn(1, SEQ, HEADS, DIM), torch.randn(1, SEQ, KV_HEADS, DIM)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    cos, sin = rope_cos_sin(torch.arange(3, 3 + SEQ, dtype=torch.int32).view(1, -1), inv_freq)
    qg, kg = torch.rand(DIM) + 0.5, torch.rand(DIM) + 0.5
    ours = FusedRoPE(0, HEADS, KV_HEADS, DIM, ((qg, 1e-6), (kg, 1e-6)))(q, k, cos, sin)
    ref = _hf(q, k, cos, sin, _norm(qg), _norm(kg))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # not vacuous: another k gamma moves k, and no norm differs from these norms
    moved = FusedRoPE(0, HEADS, KV_HEADS, DIM, ((qg, 1e-6), (kg * 1.1, 1e-6)))(q, k, cos, sin)
    assert (moved[1] - ref[1]).abs().max() > 1e-2
    plain = FusedRoPE(0, HEADS, KV_HEADS, DIM)(q, k, cos, sin)
    assert (plain[0] - ref[0]).abs().max() > 1e-2


def _extra(inputs: list[int]) -> dict:
    attrs = [{"key": "name", "s": "/layers.0/self_attn/RoPE"}, {"key": "num_head", "i": HEADS},
             {"key": "kv_num_head", "i": KV_HEADS}, {"key": "head_dim", "i": DIM}, {"key": "q_eps", "f": 1e-6},
             {"key": "k_eps", "f": 1e-5}]
    return {"type": "Extra", "inputIndexes": inputs, "outputIndexes": [10, 11], "main": {"type": "RoPE",
                                                                                         "attr": attrs}}


def test_rebuild_writes_rope_param_with_the_norm_gammas():
    gamma = [0.5 + i / 64 for i in range(DIM)]
    consts = {4: {"type": "Const", "main": {"float32s": gamma}}, 5: {"type": "Const", "main": {}}}
    op = _rope_op(_extra([0, 1, 2, 3, 4, 5]), consts)
    assert op["type"] == "RoPE" and op["inputIndexes"] == [0, 1, 2, 3] and op["outputIndexes"] == [10, 11]
    main = op["main"]
    assert (main["num_head"], main["kv_num_head"], main["head_dim"], main["rope_cut_head_dim"]) == (
        HEADS, KV_HEADS, DIM, DIM)
    assert main["q_norm"]["gamma"] == gamma and main["q_norm"]["epsilon"] == pytest.approx(1e-6)
    assert main["q_norm"]["useRMSNorm"] and "k_norm" not in main  # an empty gamma: no k norm
    with pytest.raises(ConversionError, match="k_norm gamma is not a graph constant"):
        _rope_op(_extra([0, 1, 2, 3, 4, 9]), consts)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3", "mistral"])
def test_export_is_a_c4_graph_and_verifies(tiny_decoder, tmp_path, variant):
    """Every layer's RoPE is MNN's op and the hidden state stays NC4HW4: one layout conversion pair
    at each end of the graph, not one around each linear; ``--verify`` (exact kernels) passes."""
    dst = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                           str(tiny_decoder(variant)), "--dst_path", str(dst), "--verify"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((dst / "verify.json").read_text())["passed"]
    ops = [op["type"] for op in mnn_to_json(dst / "llm.mnn", tmp_path / "llm.json")["oplists"]]
    layers = json.loads((dst / "llm_config.json").read_text())["layer_nums"]
    assert ops.count("RoPE") == ops.count("Attention") == layers
    assert ops.count("ConvertTensor") <= 4 < ops.count("Convolution")
