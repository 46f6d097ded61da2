"""MLX-quantized checkpoints exported "as stored": MLX's integers and affine map reach MNN unchanged.

Fixtures are quantized by MLX itself: tiny Gemma4 checkpoints with mlx-lm's converter
(``mlx_lm.convert``, uniform 4- and 8-bit, the mixed ``mixed_3_6`` / ``mixed_4_6`` recipes and
test-side quant predicates giving the embedding other bits or groups), a tiny K2-Horizon with
``mx.quantize`` per module (mlx-lm has no K2-Horizon port), mirroring mlx-lm's convert: its quant
predicate (modules with ``to_quantized`` whose input width the group divides) and its config
``quantization`` layout, with the family's MLX names (stacked experts). Every transcoded record
must hold MLX's integers and decode, read back from our files in fp32, to exactly
``scales.float() * q + biases.float()``; MNN's runtime must agree with the HF model carrying the
read-back weights (teacher-forced top-1 100% over 24 steps, max abs logit error < 0.2).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx[cpu] cannot be installed on this platform "
                                            "(wheels: Linux with glibc >= 2.35, macOS on Apple silicon)")
mlx_convert = pytest.importorskip("mlx_lm.convert", reason="mlx-lm cannot be installed on this platform")

from llmexport import ExportOptions, export, plan  # noqa: E402
from llmexport.errors import InputError  # noqa: E402
from llmexport.mnn.readback import linear_records  # noqa: E402
from llmexport.mnn.weight_reader import read_levels, read_linear  # noqa: E402
from llmexport.mnn.weights import WeightFileWriter  # noqa: E402
from llmexport.quant.recipes import QuantRule  # noqa: E402
from llmexport.quant.scheme import QuantMethod, QuantScheme  # noqa: E402
from llmexport.source.importers.mlx import MlxQuantConfig, mlx_quantization, unpack_levels  # noqa: E402
from llmexport.spec import Prequantized  # noqa: E402
from llmexport.verification.verify import summary_line, verify_export  # noqa: E402


def _np(array) -> np.ndarray:
    return np.array(array.astype(mx.float32))


def _mlx_quantized(bits: int, shape: tuple[int, ...], group: int = 32, seed: int = 0):
    mx.random.seed(seed)
    w = (mx.random.normal(shape) * 0.05).astype(mx.bfloat16)
    return mx.quantize(w, group_size=group, bits=bits)


def _levels_by_mlx(q, scales, biases, group: int, bits: int) -> np.ndarray:
    """MLX's own unpacking: dequantize with scale 1 and bias 0."""
    return _np(mx.dequantize(q, mx.ones_like(scales), mx.zeros_like(biases), group_size=group, bits=bits))


# --- format units -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_unpacking_and_dequantization_match_mlx(bits):
    q, s, b = _mlx_quantized(bits, (3, 16, 128))  # stacked experts [E, out, in]
    pq = Prequantized(unpack_levels(torch.from_numpy(np.array(q)), bits), torch.from_numpy(_np(s)).bfloat16(),
                      torch.from_numpy(_np(b)).bfloat16(), bits, 32)
    assert np.array_equal(pq.levels.numpy(), _levels_by_mlx(q, s, b, 32, bits))
    assert (_np(s) < 0).any()  # MLX scales can be negative: the bias is then the group's maximum
    mlx_fp32 = _np(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits))
    assert np.array_equal(pq.dequantize().numpy(), mlx_fp32)
    assert np.array_equal(pq[1].dequantize().numpy(), mlx_fp32[1])


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_transcoded_record_keeps_the_integers_and_decodes_exactly(tmp_path, bits):
    q, s, b = _mlx_quantized(bits, (40, 128))
    pq = Prequantized(unpack_levels(torch.from_numpy(np.array(q)), bits), torch.from_numpy(_np(s)).bfloat16(),
                      torch.from_numpy(_np(b)).bfloat16(), bits, 32)
    bias = torch.randn(40)
    path = tmp_path / "w.bin"
    with open(path, "wb") as f:
        record = WeightFileWriter(f, 0).write_linear(pq, bias, QuantScheme(bits, 32, method=QuantMethod.STORED))
    qp = record.quan_parameter()
    assert qp["scaleStorage"] == "FP32" and record.alpha_bytes == 40 * 4 * 2 * 4 and qp["readType"] == 40 * 4
    levels, alpha = read_levels(path, record.external(), qp, 40, 128)
    assert np.array_equal(levels + (1 << (bits - 1)), _levels_by_mlx(q, s, b, 32, bits))
    assert np.array_equal(alpha[1::2], _np(s).reshape(-1))
    weight, read_bias = read_linear(path, record.external(), qp, 40, 128)
    assert torch.equal(weight, pq.dequantize()) and torch.equal(read_bias, bias)
    with open(path, "wb") as f:  # any other scheme dequantizes first and quantizes afresh
        requantized = WeightFileWriter(f, 0).write_linear(pq, None, QuantScheme(8, 64))
    assert requantized.quan_parameter()["scaleStorage"] == "FP16"
    assert (read_linear(path, requantized.external(), requantized.quan_parameter(), 40, 128)[0]
            - pq.dequantize()).abs().max() < 2e-3


def test_parts_joined_side_by_side_keep_every_groups_map():
    """The token table joins the embedding and the PLE table: one width, one group (the parts'
    common one; a larger group is split into runs that share its scale and bias)."""
    parts = []
    for group, cols, seed in ((32, 64, 0), (64, 128, 1)):
        q, s, b = _mlx_quantized(4, (8, cols), group, seed)
        parts.append(Prequantized(unpack_levels(torch.from_numpy(np.array(q)), 4),
                                  torch.from_numpy(_np(s)).bfloat16(), torch.from_numpy(_np(b)).bfloat16(), 4, group))
    joined = Prequantized.join_columns(parts)
    assert (joined.bits, joined.group, tuple(joined.shape)) == (4, 32, (8, 192))
    assert torch.equal(joined.levels, torch.cat([p.levels for p in parts], dim=1))
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts], dim=1))
    q, s, b = _mlx_quantized(8, (8, 64), 64)
    eight = Prequantized(unpack_levels(torch.from_numpy(np.array(q)), 8), torch.from_numpy(_np(s)),
                         torch.from_numpy(_np(b)), 8, 64)
    with pytest.raises(ValueError, match="cannot join"):
        Prequantized.join_columns([parts[0], eight])


def test_quantization_config_per_module_and_detection():
    block = {"group_size": 64, "bits": 8, "mode": "affine", "a.mlp.down_proj": {"group_size": 32, "bits": 4},
             "a.router": False}
    config = MlxQuantConfig(block, "config.json")
    assert (config.for_module("a.q_proj").bits, config.for_module("a.q_proj").group) == (8, 64)
    assert str(config.for_module("a.mlp.down_proj")) == "4-bit group 32" and config.for_module("a.router") is None
    with pytest.raises(InputError, match="mxfp4"):
        MlxQuantConfig({"group_size": 32, "bits": 4, "mode": "mxfp4"}, "config.json")
    assert mlx_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}) is None
    assert mlx_quantization({"quantization_config": block}) is block


# --- fixtures quantized by MLX ------------------------------------------------------------------------
def _gemma4_hf(out: Path, shape: str) -> Path:
    from llmexport.tiny.gemma4 import SHAPES, build_tiny_gemma4, text_config_dict

    path = build_tiny_gemma4(out, shape, dtype=torch.bfloat16)
    config = json.loads((path / "config.json").read_text())
    # mlx-lm 0.32 reads these; transformers 5.24 writes none of them at the top of text_config (the
    # per-type head_dim / KV heads live in per_layer_config there)
    tiny = text_config_dict(SHAPES[shape])
    for key in ("global_head_dim", "num_global_key_value_heads"):
        if key in tiny:
            config["text_config"][key] = tiny[key]
    config["vocab_size"] = config["text_config"]["vocab_size"]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


_K2_MLP = re.compile(r"\.(gate|up|down)_proj$")
_K2_LINEAR = re.compile(r"(_proj|\.v_experts|embed_tokens|lm_head)$")


def _k2_mlx(hf: Path, out: Path) -> Path:
    """mlx-lm's convert by hand for the family's MLX port: experts stacked [E, out, in]
    (``mlp.switch_mlp.*``, ``self_attn.v_experts``), the published mix (MLP 4-bit group 32, the rest
    8-bit group 64) as a quant predicate under the default ``--q-bits 8 --q-group-size 64``, routers
    (custom modules) and norms left in bf16. Like mlx-lm's ``quantize_model``, a module whose input
    width the *default* group does not divide stays in bf16 (here: the dense layers' down_proj, 96
    wide, and the routed experts' down_proj, 32 wide)."""
    from safetensors.torch import load_file

    tensors, stacks = load_file(hf / "model.safetensors"), {}
    for name in sorted(tensors):
        m = re.match(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight$", name) or \
            re.match(r"^(.*\.self_attn\.v_experts)\.(\d+)()\.weight$", name)
        if m:
            key = f"{m[1]}.switch_mlp.{m[3]}.weight" if m[3] else f"{m[1]}.weight"
            stacks.setdefault(key, []).append((int(m[2]), tensors.pop(name)))
    tensors.update({key: torch.stack([t for _, t in sorted(parts)]) for key, parts in stacks.items()})
    quantization, arrays = {"group_size": 64, "bits": 8, "mode": "affine"}, {}
    for name, tensor in tensors.items():
        array = mx.array(tensor.float().numpy()).astype(mx.bfloat16 if tensor.dtype == torch.bfloat16 else mx.float32)
        module = name.removesuffix(".weight")
        bits, group = (4, 32) if _K2_MLP.search(module) else (8, 64)
        if not (name.endswith(".weight") and _K2_LINEAR.search(module)) or array.shape[-1] % 64:
            arrays[name] = array
            continue
        arrays[name], arrays[module + ".scales"], arrays[module + ".biases"] = mx.quantize(
            array, group_size=group, bits=bits)
        if bits != 8:
            quantization[module] = {"group_size": group, "bits": bits, "mode": "affine"}
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
    for path in hf.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, out / path.name)
    config = json.loads((hf / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _gemma4_mlx_name(name: str) -> list[tuple[str, int | None]]:
    """Placeholder -> MLX modules (and expert), by mlx-lm's gemma4 sanitize (test-side, independent)."""
    if name == "lm_head":
        return [("language_model.model.embed_tokens", None)]
    rest = name.removeprefix("model.language_model.")
    m = re.match(r"^(.*\.experts)\.(\d+)\.(gate_up_proj|down_proj)$", rest)
    if m:
        base, e = f"language_model.model.{m[1]}.switch_glu.", int(m[2])
        return [(base + "gate_proj", e), (base + "up_proj", e)] if m[3] == "gate_up_proj" else [(base + "down_proj", e)]
    return [("language_model.model." + rest, None)]


def _gemma3_mlx_name(name: str) -> list[tuple[str, int | None]]:
    return [("model.embed_tokens" if name == "lm_head" else name, None)]


def _k2_mlx_name(name: str) -> list[tuple[str, int | None]]:
    if name == "lm_head":
        return [("model.embed_tokens", None)]
    m = re.match(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+_proj)$", name) or re.match(r"^(.*\.v_experts)\.(\d+)()$", name)
    if m:
        return [(f"{m[1]}.switch_mlp.{m[3]}" if m[3] else m[1], int(m[2]))]
    return [(name, None)]


def _embedding_as(bits: int, group: int):
    """A quant predicate (mlx-lm's convert takes one) giving the token embedding its own bits and
    group, everything else mlx-lm's default 4-bit group 64."""
    def predicate(path, module):
        return {"group_size": group, "bits": bits, "mode": "affine"} if path.endswith(".embed_tokens") else True
    return predicate


#: test-side recipes: the embedding and the PLE table at different bits / groups
_PREDICATES = {"embed8": _embedding_as(8, 64), "embed-g32": _embedding_as(4, 32)}


def _gemma4_recipe(recipe: str) -> dict:
    """mlx_lm.convert's arguments for a Gemma4 fixture's recipe: "q4", "q8", "q4g128" (uniform bits
    at group 64 or the one named), a test-side predicate (``_PREDICATES``) or one of mlx-lm's
    mixed recipes ("mixed_3_6", "mixed_4_6")."""
    m = re.fullmatch(r"q(\d+)(?:g(\d+))?", recipe)
    if m:
        return dict(q_bits=int(m[1]), q_group_size=int(m[2] or 64))
    return dict(q_group_size=64, quant_predicate=_PREDICATES.get(recipe, recipe))


@pytest.fixture(scope="module")
def mlx_checkpoints(tmp_path_factory):
    """name -> (MLX checkpoint folder, placeholder -> MLX modules)."""
    from llmexport.tiny.decoders import VARIANTS as DECODER_VARIANTS
    from llmexport.tiny.decoders import build_tiny_decoder
    from llmexport.tiny.k2_horizon import build_tiny_k2_horizon

    root = tmp_path_factory.mktemp("mlx")
    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            shape, _, recipe = name.partition(":")
            if name == "k2-sparse-mlp4-attn8":
                hf = build_tiny_k2_horizon(root / "k2-hf", "sparse")
                cache[name] = (_k2_mlx(hf, root / name), _k2_mlx_name)
            elif shape in DECODER_VARIANTS:  # mlx-lm's own ports; HF names, lm_head or the tied embedding
                hf = build_tiny_decoder(root / f"{shape}-hf", shape)
                mlx_convert.convert(str(hf), str(root / shape), quantize=True, q_group_size=64, q_bits=4)
                tied = json.loads((hf / "config.json").read_text())["tie_word_embeddings"]
                cache[name] = (root / shape, _k2_mlx_name if tied else lambda module: [(module, None)])
            elif name.startswith(("gemma3-", "phi3-")):
                from llmexport.tiny.registry import TINY_BUILDERS

                hf = TINY_BUILDERS["gemma3_text" if name.startswith("gemma3-") else "phi3"](root / f"{name}-hf", 0)
                mlx_convert.convert(str(hf), str(root / name.replace(":", "-")), quantize=True, q_group_size=64,
                                    q_bits=4)
                cache[name] = (root / name.replace(":", "-"), _gemma3_mlx_name)
            else:
                hf = _gemma4_hf(root / f"{shape}-hf", shape)
                mlx_convert.convert(str(hf), str(root / name.replace(":", "-")), quantize=True,
                                    **_gemma4_recipe(recipe))
                cache[name] = (root / name.replace(":", "-"), _gemma4_mlx_name)
        return cache[name]

    return get


def _check_records(out: Path, mlx_path: Path, to_mlx, transcoded: set[str]) -> int:
    """Every transcoded record holds MLX's integers and decodes to exactly scales * q + biases."""
    arrays = mx.load(str(mlx_path / "model.safetensors"))
    quant = MlxQuantConfig(json.loads((mlx_path / "config.json").read_text())["quantization"], "config.json")
    checked = 0
    for name, rec in linear_records(out).items():
        if name not in transcoded:
            continue
        q, scales, biases = [], [], []
        for module, expert in to_mlx(name):
            info = quant.for_module(module)
            w, s, b = (arrays[f"{module}.{k}"] for k in ("weight", "scales", "biases"))
            if expert is not None:
                w, s, b = w[expert], s[expert], b[expert]
            q.append(_levels_by_mlx(w, s, b, info.group, info.bits))
            scales.append(_np(s))
            biases.append(_np(b))
        q, scales, biases = np.concatenate(q), np.concatenate(scales), np.concatenate(biases)
        levels, _ = read_levels(out / "llm.mnn.weight", rec["external"], rec["quanParameter"], rec["oc"], rec["ic"])
        assert np.array_equal(levels + (1 << (info.bits - 1)), q), name
        group = q.shape[1] // scales.shape[1]
        expected = (q.reshape(q.shape[0], -1, group) * scales[..., None] + biases[..., None]).reshape(q.shape)
        decoded, _ = read_linear(out / "llm.mnn.weight", rec["external"], rec["quanParameter"], rec["oc"], rec["ic"])
        assert np.array_equal(decoded.numpy(), expected), name
        assert rec["quanParameter"].get("scaleStorage", "FP32") == "FP32", name
        checked += 1
    return checked


# name -> (placeholders expected off "as stored", with a substring of the reason)
CASES = {
    # experts' gate/up joined from switch_glu; the router 8-bit by mlx-lm's own gemma4 predicate
    "26b-a4b:q4": {},
    # mlx-lm's default 4-bit group 64 with PLE: the joined token table keeps both tables' integers
    "e2b:q4": {},
    # 3-bit (transcoded), 6-bit v_proj/down_proj and a 3-bit tied embedding (requantized), 3-bit PLE table
    "e2b:mixed_3_6": {"lm_head": "tied lm_head", "model.language_model.layers.0.self_attn.v_proj": "6-bit",
                      "model.language_model.layers.7.mlp.down_proj": "6-bit"},
    # MoE + MoVA experts stacked; routers left in bf16 by MLX (kept as fp16 records)
    "k2-sparse-mlp4-attn8": {},
    # plain decoders at mlx-lm's default 4 bits: Qwen2 (q/k/v biases, sliding layers), Mistral
    # (every layer sliding), SmolLM3 (NoPE and sliding layers, tied embedding)
    "qwen2:q4": {}, "mistral:q4": {}, "smollm3-sliding:q4": {},
    # mlx-lm's gemma3_text port: HF's names, a 4-bit tied embedding; down_proj (96 wide) left in bf16 by MLX
    "gemma3-1b:q4": {},
    # mlx-lm's phi3 port: HF's names with the fused qkv_proj / gate_up_proj, a 4-bit tied embedding
    "phi3-phi4-mini:q4": {},
}


#: the PLE cases' token table file and bits: kept as stored at 4 bits, or bf16 (3-bit tables)
TOKEN_TABLE_FILES = {"e2b:q4": ("embeddings_int4.bin", 4), "e2b:mixed_3_6": ("embeddings_bf16.bin", 16)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mlx_checkpoint_exports_as_stored_and_verifies(mlx_checkpoints, tmp_path, case):
    mlx_path, to_mlx = mlx_checkpoints(case)
    result = export(mlx_path, tmp_path / "out", ExportOptions())
    pre = result.plan.prequantized
    requantized = {e.name: e.reason for e in pre.requantized}
    assert set(requantized) >= set(CASES[case]) and all(r in requantized[n] for n, r in CASES[case].items())
    assert not pre.quantized_from_float
    transcoded = {linear.name for linear in result.plan.linears if linear.method is QuantMethod.STORED}
    assert len(transcoded) == pre.transcoded > 0
    assert _check_records(result.dst, mlx_path, to_mlx, transcoded) == len(transcoded)
    written = sum(p.stat().st_size for p in result.dst.iterdir() if p.name == "llm.mnn.weight" or p.suffix == ".bin")
    assert result.plan.estimated_bytes == written
    manifest = json.loads((result.dst / "manifest.json").read_text())
    assert manifest["prequantized"]["transcoded"] == len(transcoded)
    assert manifest["prequantized"]["tables"] == {name: t.to_json() for name, t in pre.tables.items()}
    if case in TOKEN_TABLE_FILES:
        table, bits = TOKEN_TABLE_FILES[case]
        assert pre.tables["embedding"].kept == (bits != 16) and pre.tables["embedding"].bits == bits
        assert json.loads((result.dst / "config.json").read_text())["embedding_file"] == table

    report = verify_export(result.dst, mlx_path, steps=24, trust_remote_code=True)
    print(f"\n{case}: {summary_line(report)}; {pre.transcoded} transcoded, requantized {sorted(requantized)}")
    assert all(step.top1_match for step in report.exact_kernels.per_step)
    assert report.exact_kernels.max_abs_err < 0.2 and report.passed
    assert report.prequantized["fp32_alpha_records"] == len(transcoded)
    changed = report.prequantized["linears_changed"]
    assert not set(changed) & transcoded and set(changed) >= set(requantized)
    for name, table in report.prequantized["tables"].items():
        assert table["exact"] == pre.tables[name].kept, name


_MLX_TABLES = ("language_model.model.embed_tokens", "language_model.model.embed_tokens_per_layer")


def _written_token_table(mlx_path: Path, out: Path, options: ExportOptions):
    """The token table as the export writes it (its plan entry, file and config keys), without the graph."""
    from llmexport.planning.digests import FileDigests
    from llmexport.planning.schemes import Schemes
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture
    from llmexport.targets.mnn_target import table_config
    from llmexport.targets.token_table_writer import TokenTableWriter

    arch = open_architecture(Checkpoint.open(mlx_path))
    schemes = Schemes(arch, options.validate())
    files: dict = {}
    out.mkdir()
    writer = TokenTableWriter(schemes, out, FileDigests())
    name = table_config(writer, writer.result(), {}, files)
    return arch, schemes, out / name, files


# recipe -> (bits, block) of the joined token table kept as stored
KEPT_TABLES = {
    "e2b:q4": (4, 64),  # mlx-lm's default
    "e2b:q8": (8, 64),
    "e2b:mixed_4_6": (4, 64),  # mixed recipe: the tables get the low bits, some linears 6
    "e2b:embed-g32": (4, 32),  # groups 32 and 64: held at 32, the PLE's groups split in runs of two
}


@pytest.mark.parametrize("case", sorted(KEPT_TABLES))
def test_joined_token_table_keeps_mlx_integers(mlx_checkpoints, tmp_path, case):
    """Gemma4's embedding and PLE table, joined into one MNN table, keep MLX's integers: every row
    read back as the runtime decodes it equals mx.dequantize of both tables exactly."""
    from llmexport.mnn.embeddings import read_embedding_table, table_size
    from llmexport.mnn.token_table import stored_row

    mlx_path, _ = mlx_checkpoints(case)
    bits, block = KEPT_TABLES[case]
    pre = plan(mlx_path, ExportOptions()).prequantized
    assert pre.tables["embedding"].to_json() == {"stored": pre.tables["embedding"].stored, "bits": bits,
                                                  "block": block, "kept": True, "reason": None}
    arch, schemes, path, files = _written_token_table(mlx_path, tmp_path / "out", ExportOptions())
    assert path.name == f"embeddings_int{bits}.bin"
    arrays = mx.load(str(mlx_path / "model.safetensors"))
    quant = MlxQuantConfig(json.loads((mlx_path / "config.json").read_text())["quantization"], "config.json")
    levels, values = [], []
    for module in _MLX_TABLES:
        info = quant.for_module(module)
        w, s, b = (arrays[f"{module}.{k}"] for k in ("weight", "scales", "biases"))
        levels.append(_levels_by_mlx(w, s, b, info.group, info.bits))
        values.append(_np(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=info.group,
                                        bits=info.bits)))
    levels, values = np.concatenate(levels, axis=1), np.concatenate(values, axis=1)
    rows, dim = values.shape
    assert path.stat().st_size == table_size(rows, dim, bits, block) == files["tie_embeddings"]["alpha_offset"] + \
        files["tie_embeddings"]["alpha_size"]
    assert (files["hidden_size"], files["tie_embeddings"]["quant_bit"], files["tie_embeddings"]["quant_block"]) == \
        (dim, bits, block)
    raw = np.fromfile(path, dtype=np.uint8, count=rows * dim * bits // 8)
    stored = raw if bits == 8 else np.stack([raw >> 4, raw & 0x0F], axis=-1)  # 4-bit: high nibble first
    assert np.array_equal(stored.reshape(rows, dim), levels)
    decoded = read_embedding_table(path, rows, dim, bits, block).numpy()
    print(f"\n{case}: {path.name} {path.stat().st_size} bytes ({rows} x {dim}), read-back max abs diff "
          f"{float(np.abs(decoded - values).max())}")
    assert np.array_equal(decoded, values)
    _, choice = schemes.tables()["embedding"]  # the media soft tokens' PLE tail is a row of this table
    assert torch.equal(stored_row(choice.rows, 3, choice.bits, choice.block, choice.quantizer),
                       torch.from_numpy(decoded[3]))


# recipe (options) -> a substring of the reason the joined token table is requantized
REQUANTIZED_TABLES = {
    "e2b:embed8": "stored as 8-bit group 64 and 4-bit group 64: one table has one width",
    "e2b:q4g128": "stored quantized and in floats",  # MLX leaves the 64-wide embedding in bf16 at group 128
    "e2b:mixed_3_6": "3-bit: MNN 3.6.1 decodes tables at 4 or 8 bits only",
    "e2b:q4 --embed_bit 8": "--embed_bit",
}


@pytest.mark.parametrize("case", sorted(REQUANTIZED_TABLES))
def test_joined_token_table_that_one_table_cannot_hold_is_requantized(mlx_checkpoints, tmp_path, case):
    from click.testing import CliRunner

    from llmexport.cli import main

    name, _, flags = case.partition(" ")
    mlx_path, _ = mlx_checkpoints(name)
    options = ExportOptions(embed_bit=8) if flags else ExportOptions()
    table = plan(mlx_path, options).prequantized.tables["embedding"]
    assert not table.kept and REQUANTIZED_TABLES[case] in table.reason
    assert table.bits == (8 if flags else 16)
    result = CliRunner().invoke(main, ["--path", str(mlx_path), "--dst_path", "unused", "--dry-run", *flags.split()])
    assert result.exit_code == 0 and f"{table.bits} bits: {table.reason}" in result.output, result.output
    _, _, path, _ = _written_token_table(mlx_path, tmp_path / "out", options)
    assert path.name == ("embeddings_int8.bin" if flags else "embeddings_bf16.bin")


def test_explicit_options_override_as_stored(mlx_checkpoints):
    from click.testing import CliRunner

    from llmexport.cli import main

    mlx_path, _ = mlx_checkpoints("26b-a4b:q4")
    assert plan(mlx_path, ExportOptions(requantize=True)).prequantized.transcoded == 0
    rule = QuantRule("*.self_attn.o_proj", QuantScheme(8, 32))
    pre = plan(mlx_path, ExportOptions(rules=(rule,), lm_quant=QuantScheme(8, 64))).prequantized
    reasons = {e.name: e.reason for e in pre.requantized}
    assert reasons["lm_head"] == "--lm_quant_bit/--lm_quant_block"
    assert reasons["model.language_model.layers.0.self_attn.o_proj"] == "quant_config rule '*.self_attn.o_proj'"
    result = CliRunner().invoke(main, ["--path", str(mlx_path), "--dst_path", "unused", "--dry-run", "--requantize"])
    assert result.exit_code == 0 and "requantize requested" in result.output and "0 linear(s) keep" in result.output


def test_lora_on_an_mlx_checkpoint_needs_requantize(mlx_checkpoints, tmp_path):
    """An adapter changes the weights before they are quantized: MLX's stored integers cannot be kept."""
    from safetensors.torch import save_file

    from llmexport.errors import UsageError
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture

    path, _ = mlx_checkpoints("qwen2:q4")
    q = "model.layers.0.self_attn.q_proj"
    base = open_architecture(Checkpoint.open(path)).linear_weight(q)[0]  # MLX's values, dequantized
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    torch.manual_seed(0)
    a, b = torch.randn(2, base.shape[1]), torch.randn(base.shape[0], 2)
    save_file({f"base_model.model.{q}.lora_A.weight": a, f"base_model.model.{q}.lora_B.weight": b},
              adapter / "adapter_model.safetensors")
    with pytest.raises(UsageError, match="--lora_path: this pre-quantized checkpoint keeps its stored integers"):
        plan(path, ExportOptions(lora=adapter))
    planned = plan(path, ExportOptions(lora=adapter, requantize=True))
    assert not any(linear.method is QuantMethod.STORED for linear in planned.linears)
    merged = open_architecture(Checkpoint.open(path), adapter).linear_weight(q)[0]
    assert (merged - (base.double() + 2 * b.double() @ a.double()).float()).abs().max() < 1e-6


def test_activation_scaling_of_an_mlx_checkpoint_needs_requantize(mlx_checkpoints, tmp_path):
    """AWQ / SmoothQuant rescale the weights before rounding them afresh: an MLX checkpoint's stored
    integers cannot be kept, so it is refused as GPTQ is, before anything is written."""
    from click.testing import CliRunner

    from llmexport.cli import main

    mlx_path, _ = mlx_checkpoints("qwen2:q4")
    text = tmp_path / "calib.txt"
    text.write_text("calibration text " * 400)
    for method in ("awq", "smooth+gptq"):
        dst = tmp_path / f"out-{method}"
        result = CliRunner().invoke(main, ["--path", str(mlx_path), "--dst_path", str(dst), "--calib_data", str(text),
                                           "--calib_method", method])
        assert result.exit_code == 2 and "needs --requantize" in result.output, result.output
        assert not dst.exists()
