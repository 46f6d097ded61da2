"""Every float of the traced graphs reaches the exported .mnn files bit for bit.

The export goes ONNX -> MNN (converter) -> JSON -> rebuilt JSON -> MNN, and the converter's JSON
dump prints floats with six decimals (llmexport/mnn/exact_floats.py). For every family and shape,
each graph (llm, visual, audio, each MoE expert template) of Gemma4, K2-Horizon (incl. its real
RoPE setting, base 1e7 at head_dim 128), Llama, Qwen3-MoE, LFM2 (its conv kernels) and Qwen3.5-MoE
is checked three ways:

1. the converter's own output holds the traced ONNX constants bit for bit (the starting point);
2. every op of the converter's output that carries floats (constants, attention scales, clip
   bounds, norm epsilons, reduction coefficients...) has the same floats, bit for bit, in the
   exported file; placeholders are checked against what replaced them (Attention's attnScale);
3. MNN's own reader (``MNN.expr.load_as_dict``) finds every traced constant in the exported
   graph bit for bit, including the large ones carried in the weight file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from llmexport import ExportOptions, export
from llmexport.mnn import convert
from llmexport.mnn.convert import mnn_to_json
from llmexport.quant.scheme import QuantScheme

CASES = [
    pytest.param(("gemma4", "e2b"), id="gemma4-e2b"),
    pytest.param(("gemma4", "e4b"), id="gemma4-e4b", marks=pytest.mark.slow),
    pytest.param(("gemma4", "31b"), id="gemma4-31b", marks=pytest.mark.slow),
    pytest.param(("gemma4", "26b-a4b"), id="gemma4-26b-a4b", marks=pytest.mark.slow),
    pytest.param(("multimodal", "vision-audio-64"), id="gemma4-vision-audio", marks=pytest.mark.slow),
    pytest.param(("multimodal", "vision-1536"), id="gemma4-vision-1536", marks=pytest.mark.slow),
    pytest.param(("k2", "dense"), id="k2-dense", marks=pytest.mark.slow),
    pytest.param(("k2", "sparse"), id="k2-sparse"),
    pytest.param(("k2", "sparse-qknorm"), id="k2-sparse-qknorm", marks=pytest.mark.slow),
    # the family's real rotary setting: head_dim 128, base 1e7 (inverse frequencies down to 1.3e-7)
    pytest.param(("k2", "dense-hd128"), id="k2-dense-hd128"),
    # base 5e5 with Llama-3 frequency rescaling; Qwen3-MoE: base 1e6, q/k norms, a router
    pytest.param(("decoder", "llama3"), id="llama3"),
    pytest.param(("decoder", "qwen3-moe"), id="qwen3-moe", marks=pytest.mark.slow),
    # LFM2: the short convs' kernels [hidden, 1, kernel] are graph constants (LinearAttention's input)
    pytest.param(("lfm2", "dense"), id="lfm2-dense"),
    pytest.param(("lfm2", "moe"), id="lfm2-moe", marks=pytest.mark.slow),
    # Qwen3.5: the Gated DeltaNet conv kernels, A_log and dt_bias (the recurrence is sensitive to them)
    pytest.param(("qwen3_5", "qwen3_5-moe"), id="qwen3_5-moe", marks=pytest.mark.slow),
]
K2_CONFIGS = {"dense-hd128": ("dense", dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1))}


def _checkpoint(request, family: str, name: str, tmp_path_factory) -> Path:
    if family == "gemma4":
        return request.getfixturevalue("tiny_gemma4")(name)
    if family == "k2" and name in K2_CONFIGS:
        from llmexport.tiny.k2_horizon import build_k2_horizon_checkpoint, variant_config

        variant, overrides = K2_CONFIGS[name]
        return build_k2_horizon_checkpoint(tmp_path_factory.mktemp(name), {**variant_config(variant), **overrides})
    if family == "k2":
        return request.getfixturevalue("tiny_k2_horizon")(name)
    if family == "decoder":
        return request.getfixturevalue("tiny_decoder")(name)
    if family == "lfm2":
        return request.getfixturevalue("tiny_lfm2")(name)
    if family == "qwen3_5":
        return request.getfixturevalue("tiny_qwen3_5")(name)
    from llmexport.tiny.gemma4_towers import build_tiny_multimodal

    return build_tiny_multimodal(tmp_path_factory.mktemp(name), name)


@pytest.fixture(scope="module")
def exported(request, tmp_path_factory):
    """``exported(case)`` -> (export folder, {stem: (traced ONNX, converter output .mnn)})."""
    cache = {}

    def get(case):
        if case not in cache:
            keep = tmp_path_factory.mktemp("traced")
            original = convert.onnx_to_mnn

            def onnx_to_mnn_kept(onnx_path: Path, mnn_path: Path) -> None:
                original(onnx_path, mnn_path)
                for path in (onnx_path, mnn_path, mnn_path.with_suffix(".mnn.weight")):
                    if path.exists():
                        shutil.copy(path, keep / path.name)

            out = tmp_path_factory.mktemp("export") / "out"
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(convert, "onnx_to_mnn", onnx_to_mnn_kept)
                export(_checkpoint(request, *case, tmp_path_factory), out,
                       ExportOptions(quant=QuantScheme(bits=4, block=32)))
            cache[case] = out, {p.stem: (p, p.with_suffix(".mnn")) for p in keep.glob("*.onnx")}
        return cache[case]

    return get


def traced_constants(onnx_path: Path) -> dict[str, np.ndarray]:
    """Float initializers and Constant-node outputs of a traced graph, by tensor name."""
    model = onnx.load(str(onnx_path))
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return {name: v for name, v in values.items() if v.dtype == np.float32}


def traced_attributes(onnx_path: Path) -> dict[str, dict[str, float]]:
    """Float attributes of the traced graph's nodes, by first output name."""
    model = onnx.load(str(onnx_path))
    return {node.output[0]: {a.name: a.f for a in node.attribute if a.type == onnx.AttributeProto.FLOAT}
            for node in model.graph.node}


def _floats(value) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _floats(v)]
    if isinstance(value, list):
        return [f for v in value for f in _floats(v)]
    return []


def bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(-1).view(np.int32)


def max_ulp(a, b) -> int:
    """Largest distance in float32 units in the last place (0 = identical bits)."""
    a, b = bits(a).astype(np.int64), bits(b).astype(np.int64)
    return int(np.abs(a - b).max()) if a.size else 0


def _ops_by_output(ops: list[dict], tensors: list[str]) -> dict[str, dict]:
    return {tensors[op["outputIndexes"][0]]: op for op in ops if op.get("outputIndexes")}


def _carries_floats(op: dict) -> bool:
    main = op.get("main")
    if op.get("type") == "Extra" and main.get("type") in ("Linear", "MoE"):
        return False  # replaced by convolution records / the MoE op, which keep no traced float
    return bool(_floats(main))


def _layer_norm_floats(main: dict) -> list[float]:
    return [main["epsilon"], *main.get("gamma", []), *main.get("beta", [])]


def _exported_floats(op: dict) -> list[float]:
    if op["type"] == "Attention":
        return [op["main"]["attnScale"]]
    if op["type"] == "LayerNorm" and "external" not in op["main"]:
        return _layer_norm_floats(op["main"])
    return _floats(op["main"])


def _converted_floats(op: dict, weight: Path) -> list[float]:
    """The floats of a converter op; a folded RMSNorm's gamma and beta, which the converter keeps
    in its weight file and the export puts back into the op (llmexport/mnn/external.py), read
    from there."""
    main = op["main"]
    if op.get("type") == "Extra" and main["type"] == "Attention":
        return [next(a["f"] for a in main["attr"] if a["key"] == "scale")]
    if op.get("type") == "LayerNorm" and main.get("external"):
        offset, gamma, beta = (int(v) for v in main["external"][:3])
        with open(weight, "rb") as f:
            f.seek(offset)
            values = np.frombuffer(f.read(gamma + beta), dtype="<f4").astype(float).tolist()
        return [main["epsilon"], *values]
    return _floats(main)


def _final_graphs(out: Path, stem: str, tmp: Path) -> list[tuple[list[dict], list[str]]]:
    """(ops, tensor names) of the exported graph a traced stem became: expert templates became
    the subgraphs of llm.mnn."""
    if stem.startswith("expert"):
        graph = mnn_to_json(out / "llm.mnn", tmp / "final.json")
        return [(sub["nodes"], sub["tensors"]) for sub in graph.get("subgraphs", [])]
    graph = mnn_to_json(out / f"{stem}.mnn", tmp / "final.json")
    return [(graph["oplists"], graph["tensorName"])]


@pytest.mark.parametrize("case", CASES)
def test_every_traced_float_reaches_the_export_bit_for_bit(exported, case, tmp_path):
    out, traced = exported(case)
    assert "llm" in traced
    for stem, (onnx_path, converted_path) in sorted(traced.items()):
        constants, attributes = traced_constants(onnx_path), traced_attributes(onnx_path)
        converted = mnn_to_json(converted_path, tmp_path / f"{stem}.json")
        weight = converted_path.with_suffix(".mnn.weight")
        float_ops = {name: op for name, op in _ops_by_output(converted["oplists"], converted["tensorName"]).items()
                     if _carries_floats(op)}
        # 1. the converter's output starts from the traced values
        for name, op in float_ops.items():
            if op["type"] == "Const" and name in constants and "float32s" in op["main"]:
                assert max_ulp(op["main"]["float32s"], constants[name]) == 0, (stem, name)
            if op["type"] == "Extra" and op["main"]["type"] == "Attention":
                assert max_ulp(_converted_floats(op, weight), [attributes[name]["scale"]]) == 0, (stem, name)
        # 2. every float-carrying op is unchanged in the exported graph
        matched = 0
        for ops, tensors in _final_graphs(out, stem, tmp_path):
            final = _ops_by_output(ops, tensors)
            if not set(float_ops) <= set(final):
                assert not stem.startswith("llm"), sorted(set(float_ops) - set(final))[:5]
                continue  # another expert template's subgraph
            matched += 1
            for name, op in float_ops.items():
                exported_op = final[name]
                if exported_op["type"] == "LayerNorm" and "external" in exported_op["main"]:
                    continue  # a large gamma moved to the export's weight file: checked by the test below
                assert max_ulp(_exported_floats(exported_op), _converted_floats(op, weight)) == 0, (stem, name)
        assert matched or not float_ops, stem


def _external_payload(out: Path, stem: str, tmp: Path) -> dict[str, np.ndarray]:
    """Constants the export carries in ``{stem}.mnn.weight`` (over 1024 elements), by tensor name."""
    graph = mnn_to_json(out / f"{stem}.mnn", tmp / "external.json")
    payload = {}
    with open(out / f"{stem}.mnn.weight", "rb") as f:
        for op in graph["oplists"]:
            main = op.get("main", {})
            if op["type"] == "Const" and main.get("external") and main.get("dataType") == "DT_FLOAT":
                f.seek(int(main["external"][0]))
                payload[graph["tensorName"][op["outputIndexes"][0]]] = np.frombuffer(
                    f.read(int(main["external"][1])), dtype="<f4")
    return payload


@pytest.mark.parametrize("case", CASES)
def test_mnn_reads_the_traced_constants_from_the_export(exported, case, tmp_path):
    """Independent of the JSON reader: MNN's own loader on the exported files. Its Python loader
    cannot read constants kept in the weight file (``readMap`` error); those are read from the
    offsets the graph records."""
    import MNN.expr as F

    out, traced = exported(case)
    for stem, (onnx_path, converted_path) in sorted(traced.items()):
        if stem.startswith("expert"):
            continue  # subgraphs are not loaded as variables; checked by the test above
        constants = traced_constants(onnx_path)
        converted = mnn_to_json(converted_path, tmp_path / "converted.json")
        expected = {converted["tensorName"][op["outputIndexes"][0]] for op in converted["oplists"]
                    if op["type"] == "Const"} & set(constants)
        external = _external_payload(out, stem, tmp_path)
        variables = F.load_as_dict(str(out / f"{stem}.mnn"))
        found = set()
        for name, var in variables.items():
            if name in constants and var.op_type == "Const":
                stored = external[name] if name in external else np.asarray(var.read())
                assert max_ulp(stored, constants[name]) == 0, (stem, name)
                found.add(name)
        assert found == expected and found, (stem, sorted(expected - found)[:5])
