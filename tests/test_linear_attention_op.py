"""MNN's LinearAttention op alone against the placeholder's eager reference (llmexport/trace/ops.py).

A one-op graph (written as JSON, converted by MNN's converter, run with ``MNN.nn`` at precision
normal): inputs qkv [1, channels, seq], gate and beta [1, seq, v_heads], the conv weight
[channels, 1, kernel]; output [1, seq, v_heads, v_dim]. One module load runs a prefill and then
single tokens: without the LLM engine the op zeroes its state on a multi-token call and carries it
through one-token calls (CPULinearAttention::onResize), which the eager reference reproduces from
the state it returns. Random inputs of the op's own scale; the bound is fp32 accumulation noise.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.mnn.convert import json_to_mnn
from llmexport.mnn.rebuild import _linear_attention_op
from llmexport.mnn.runtime import run_module
from llmexport.trace.ops import GATED_DELTA_RULE, SHORT_CONV, FusedLinearAttention, gated_delta_rule

NAMES = ["qkv", "gate", "beta", "conv_weight", "out"]


def _input(name: str, index: int) -> dict:
    return {"name": name, "type": "Input", "main_type": "Input", "outputIndexes": [index],
            "main": {"dims": [-1], "dtype": "DT_FLOAT", "dformat": "NCHW"}, "defaultDimentionFormat": "NHWC"}


def _graph(path, op: FusedLinearAttention) -> None:
    extra = {"type": "Extra", "inputIndexes": [0, 1, 2, 3], "outputIndexes": [4],
             "main": {"type": "LinearAttention", "attr": [
                 {"key": "name", "s": op.name}, {"key": "attn_type", "s": op.attn_type},
                 {"key": "num_k_heads", "i": op.num_k_heads}, {"key": "num_v_heads", "i": op.num_v_heads},
                 {"key": "head_k_dim", "i": op.head_k_dim}, {"key": "head_v_dim", "i": op.head_v_dim},
                 {"key": "use_qk_l2norm", "i": int(op.use_qk_l2norm)}]}}
    ops = [_input(name, i) for i, name in enumerate(NAMES[:4])] + [_linear_attention_op(extra)]
    graph = {"oplists": ops, "tensorName": NAMES, "tensorNumber": len(NAMES), "outputName": ["out"],
             "sourceType": "ONNX", "preferForwardType": "CPU", "usage": "INFERENCE"}
    json_to_mnn(graph, path.with_suffix(".json"), path)


def _inputs(op: FusedLinearAttention, channels: int, kernel: int, lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    conv_channels = channels // 3 if op.attn_type == SHORT_CONV else channels  # short_conv convolves B * x
    conv_weight = torch.randn(conv_channels, 1, kernel, generator=g) * 0.5
    calls = []
    for n in lengths:
        qkv = torch.randn(1, channels, n, generator=g)
        gate = -torch.rand(1, n, op.num_v_heads, generator=g) * 2  # log-decay <= 0, as -A * softplus(a + dt)
        beta = torch.rand(1, n, op.num_v_heads, generator=g)
        calls.append((qkv, gate, beta, conv_weight))
    return calls


def _check(tmp_path, op: FusedLinearAttention, channels: int, kernel: int, lengths: list[int], seed: int) -> float:
    model = tmp_path / "la.mnn"
    _graph(model, op)
    calls = _inputs(op, channels, kernel, lengths, seed)
    feeds = [{name: t.numpy() for name, t in zip(NAMES, call)} for call in calls]
    runs = run_module(model, feeds, ["out"], thread_num=1)
    state, worst = None, 0.0
    for call, run in zip(calls, runs):
        fresh = call[0].shape[-1] > 1  # a multi-token call starts a new sequence in the op
        expected, state = op.reference(*call, state=None if fresh else state)
        got = run["out"].reshape(expected.shape)
        scale = float(expected.abs().max()) + 1e-6
        worst = max(worst, float(np.abs(got - expected.numpy()).max()) / scale)
    return worst


def test_gated_delta_rule_prefill_then_decode(tmp_path):
    op = FusedLinearAttention(0, GATED_DELTA_RULE, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16,
                              use_qk_l2norm=True)
    channels = 2 * 2 * 8 + 4 * 16
    assert _check(tmp_path, op, channels, 4, [7, 1, 1, 1, 5, 1], seed=0) < 2e-5


def test_short_conv_prefill_then_decode(tmp_path):
    op = FusedLinearAttention(0, SHORT_CONV, 1, 1, head_k_dim=24, head_v_dim=24, use_qk_l2norm=False)
    assert _check(tmp_path, op, 3 * 24, 3, [6, 1, 1, 4, 1], seed=1) < 2e-5


@settings(max_examples=6, deadline=None)
@given(k_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]), k_dim=st.sampled_from([4, 8, 16]),
       v_dim=st.sampled_from([4, 8, 32]), kernel=st.sampled_from([2, 3, 4]),
       first=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_gated_delta_rule_shapes(tmp_path_factory, k_heads, group, k_dim, v_dim, kernel, first, seed):
    op = FusedLinearAttention(0, GATED_DELTA_RULE, k_heads, k_heads * group, k_dim, v_dim, use_qk_l2norm=True)
    channels = 2 * k_heads * k_dim + k_heads * group * v_dim
    assert _check(tmp_path_factory.mktemp("la"), op, channels, kernel, [first, 1, 1], seed) < 2e-5


def test_the_check_sees_a_state_that_is_not_carried(tmp_path):
    """The eager side fed from zeros at each one-token call differs visibly from the op."""
    op = FusedLinearAttention(0, GATED_DELTA_RULE, 1, 2, 8, 8, use_qk_l2norm=True)
    channels = 2 * 8 + 2 * 8
    calls = _inputs(op, channels, 4, [5, 1], seed=3)
    _, state = op.reference(*calls[0])
    carried, _ = op.reference(*calls[1], state=state)
    dropped, _ = op.reference(*calls[1])
    assert float((carried - dropped).abs().max()) > 1e-2


def test_reference_in_pieces_equals_whole():
    """The reference's returned state continues a sequence exactly as one call over it."""
    op = FusedLinearAttention(0, GATED_DELTA_RULE, 2, 4, 8, 8, use_qk_l2norm=True)
    whole = _inputs(op, 2 * 16 + 32, 4, [9], seed=4)[0]
    full, _ = op.reference(*whole)
    first, state = op.reference(whole[0][..., :5], whole[1][:, :5], whole[2][:, :5], whole[3])
    rest, _ = op.reference(whole[0][..., 5:], whole[1][:, 5:], whole[2][:, 5:], whole[3], state=state)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-6)


def test_gated_delta_rule_matches_transformers():
    """The reference's recurrence is transformers' (Qwen3.5's torch_recurrent_gated_delta_rule)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 6, 2, 8, generator=g), torch.randn(1, 6, 2, 8, generator=g)
    v = torch.randn(1, 6, 4, 16, generator=g)
    gate, beta = -torch.rand(1, 6, 4, generator=g), torch.rand(1, 6, 4, generator=g)
    ours, state = gated_delta_rule(q, k, v, gate, beta, l2norm=True)
    theirs, their_state = torch_recurrent_gated_delta_rule(q, k, v, gate, beta, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, their_state, rtol=1e-5, atol=1e-6)
