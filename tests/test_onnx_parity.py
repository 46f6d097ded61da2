"""Stage 2 parity: ONNX traced from the rewrite, run by onnxruntime, equals the eager rewrite."""

from __future__ import annotations

import onnx

from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.trace.eager import bind_weights
from llmexport.trace.onnx_export import export_onnx

from conftest import GEMMA4_SHAPES
from families import parametrize
from helpers import assert_reference_onnx_matches_eager


@parametrize("onnx", "shape", GEMMA4_SHAPES, "gemma4")
def test_reference_onnx_matches_eager(tiny_gemma4, tmp_path, shape):
    arch = open_architecture(Checkpoint.open(tiny_gemma4(shape)))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "ref.onnx")


def test_mnn_flavour_has_placeholders_not_weights(tiny_gemma4, tmp_path):
    arch = open_architecture(Checkpoint.open(tiny_gemma4("e2b")))
    path = export_onnx(arch.build_graph(), arch.graph_inputs(3), tmp_path / "llm.onnx", for_mnn=True)
    model = onnx.load(str(path))
    custom = [n for n in model.graph.node if n.domain == "LlmExport"]
    linear_names = {a.s.decode() for n in custom if n.op_type == "Linear" for a in n.attribute if a.name == "name"}
    assert linear_names == {spec.name for spec in arch.linears()}
    attention = [n for n in custom if n.op_type == "Attention"]
    shared = {int(next(a.i for a in n.attribute if a.name == "layer_index")):
              int(next(a.i for a in n.attribute if a.name == "kv_shared_layer_index")) for n in attention}
    assert shared == {0: -1, 1: -1, 2: -1, 3: -1, 4: -1, 5: 4, 6: 4, 7: 2}
    # Only small constants (norm gammas, RoPE frequencies) stay in the file.
    assert path.stat().st_size < 400_000
