"""Stage 1 parity: the trace-friendly rewrite, run eagerly, equals HF's Gemma4 modules."""

from __future__ import annotations

import pytest
import torch

from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.trace.eager import bind_weights, prompt_inputs

from conftest import GEMMA4_SHAPES
from families import parametrize


def _rewrite_and_reference(path, ids):
    arch = open_architecture(Checkpoint.open(path))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    with torch.no_grad():
        ours = graph(*prompt_inputs(arch, ids, arch.embedding_table(), arch.ple_table()))[0][0]
    ref = arch.reference_logits(arch.load_reference(None), ids)
    return arch, graph, ours, ref


@pytest.mark.parametrize("shape", GEMMA4_SHAPES)
@parametrize("rewrite", "text_only", [False, True], lambda text_only: "gemma4_text" if text_only else "gemma4")
def test_rewrite_matches_hf(tiny_gemma4, shape, text_only):
    torch.manual_seed(1)
    ids = torch.randint(5, 500, (21,))  # longer than the sliding window (8)
    _, _, ours, ref = _rewrite_and_reference(tiny_gemma4(shape, text_only), ids)
    assert ours.shape == ref.shape == (21, 512)
    assert ref.abs().max() > 0.5  # logits are not degenerate
    assert (ours - ref).abs().max().item() < 1e-4


def test_parity_check_detects_a_wrong_gamma(tiny_gemma4):
    """Guards against a vacuous comparison: one altered norm gamma must show."""
    torch.manual_seed(1)
    ids = torch.randint(5, 500, (21,))
    arch, graph, ours, ref = _rewrite_and_reference(tiny_gemma4("e2b"), ids)
    with torch.no_grad():
        graph.layers[3].post_feedforward_layernorm.weight.mul_(1.05)
        altered = graph(*prompt_inputs(arch, ids, arch.embedding_table(), arch.ple_table()))[0][0]
    assert (altered - ref).abs().max().item() > 1e-3


def test_kv_shared_layers_read_the_last_layer_of_their_type(tiny_gemma4):
    arch = open_architecture(Checkpoint.open(tiny_gemma4("e2b")))
    layers = arch.args.layers
    # e2b: types s s f s s | s s f with 3 shared layers -> sources 4, 4, 2
    assert [layer.kv_source for layer in layers] == [-1, -1, -1, -1, -1, 4, 4, 2]
    assert {layer.index for layer in layers if layer.stores_kv} == {2, 4}
    assert [layer.mlp_width for layer in layers][-3:] == [192, 192, 192]  # double-wide on shared layers
    assert layers[2].head_dim == 32 and layers[0].head_dim == 16
