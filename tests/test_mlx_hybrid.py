"""MLX checkpoints of the hybrid families (LFM2, LFM2-MoE, Qwen3.5, Qwen3.5-MoE), quantized by mlx-lm's
own converter (``mlx_lm.convert``, 4-bit group 64) from our tiny HF checkpoints.

mlx-lm renames and reshapes these families' tensors (``sanitize`` in mlx_lm/models/lfm2.py,
lfm2_moe.py, qwen3_5.py, qwen3_5_moe.py): conv kernels ``[C, K, 1]``, Qwen3.5's ``1 + w`` norm
gammas folded into the stored weight, stacked ``switch_mlp`` experts, LFM2-MoE's MLPs as
gate/up/down_proj, the multimodal text model under ``language_model.``. The HF view must give back
HF's shapes and values (the float tensors exactly where mlx-lm stored them unchanged), and an export
must keep MLX's integers and pass verification against the HF model carrying them.

The tiny HF checkpoints need what mlx-lm 0.32 reads and transformers 5.25 does not write: LFM2's
``block_dim`` / ``block_ff_dim``, Qwen3.5's ``full_attention_interval`` (mlx-lm ignores
``layer_types``), and Qwen3.5-MoE's experts stacked as ``gate_up_proj`` / ``down_proj`` (the only
layout its sanitize reads).
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

from safetensors.torch import load_file, save_file  # noqa: E402
from test_mlx_import import _check_records  # noqa: E402

from llmexport import ExportOptions, export  # noqa: E402
from llmexport.errors import InputError  # noqa: E402
from llmexport.mnn.config import RuntimeProfile  # noqa: E402
from llmexport.models.tensor_names import rename_rule  # noqa: E402
from llmexport.quant.scheme import QuantMethod  # noqa: E402
from llmexport.reference.streamed import mapped_blocks, streamed_reference  # noqa: E402
from llmexport.source.checkpoint import Checkpoint, CheckpointTensors  # noqa: E402
from llmexport.source.importers.mlx import MlxCheckpoint  # noqa: E402
from llmexport.source.loading import open_architecture  # noqa: E402
from llmexport.spec import MlxLayout  # noqa: E402
from llmexport.tiny.lfm2 import build_tiny_lfm2  # noqa: E402
from llmexport.tiny.qwen3_5 import build_tiny_qwen3_5  # noqa: E402
from llmexport.verification.verify import summary_line, verify_export  # noqa: E402


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _lfm2_for_mlx(hf: Path) -> None:
    _edit_config(hf, lambda c: c.update(block_dim=c["hidden_size"], block_ff_dim=c["intermediate_size"]))


def _qwen3_5_for_mlx(hf: Path) -> None:
    """``full_attention_interval`` 2 (the tiny layer_types alternate), experts stacked as released."""
    _edit_config(hf, lambda c: c["text_config"].update(full_attention_interval=2))
    path = hf / "model.safetensors"
    tensors = load_file(str(path))
    for key in [k for k in tensors if k.endswith(".experts.0.gate_proj.weight")]:
        base = key.removesuffix(".0.gate_proj.weight")
        count = sum(1 for k in tensors if re.fullmatch(re.escape(base) + r"\.\d+\.gate_proj\.weight", k))
        parts = {p: [tensors.pop(f"{base}.{e}.{p}.weight") for e in range(count)]
                 for p in ("gate_proj", "up_proj", "down_proj")}
        tensors[base + ".gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(parts["gate_proj"],
                                                                                    parts["up_proj"])])
        tensors[base + ".down_proj"] = torch.stack(parts["down_proj"])
    save_file(tensors, str(path), metadata={"format": "pt"})


#: name -> (tiny builder, the edit mlx-lm needs)
BUILDS = {
    "lfm2": (lambda out: build_tiny_lfm2(out, "dense"), _lfm2_for_mlx),
    "lfm2-moe": (lambda out: build_tiny_lfm2(out, "moe"), _lfm2_for_mlx),
    "qwen3_5": (lambda out: build_tiny_qwen3_5(out, "qwen3_5"), _qwen3_5_for_mlx),
    "qwen3_5-moe": (lambda out: build_tiny_qwen3_5(out, "qwen3_5-moe"), _qwen3_5_for_mlx),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF folder as built, MLX folder converted by mlx-lm at 4 bits, group 64, from a copy
    given what mlx-lm reads)."""
    root = tmp_path_factory.mktemp("mlx-hybrid")
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            build, prepare = BUILDS[name]
            hf = build(root / f"{name}-hf")
            source = shutil.copytree(hf, root / f"{name}-for-mlx")
            prepare(source)
            mlx_convert.convert(str(source), str(root / name), quantize=True, q_group_size=64, q_bits=4)
            cache[name] = (hf, root / name)
        return cache[name]

    return get


def _lfm2_mlx_name(name: str) -> list[tuple[str, int | None]]:
    """Placeholder -> MLX module (and expert), by mlx-lm's lfm2/lfm2_moe sanitize (test-side)."""
    if name == "lm_head":
        return [("model.embed_tokens", None)]
    renamed = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    m = re.match(r"^(.*\.feed_forward)\.experts\.(\d+)\.(w\d)$", name)
    if m:
        return [(f"{m[1]}.switch_mlp.{renamed[m[3]]}", int(m[2]))]
    m = re.match(r"^(.*\.feed_forward)\.(w\d)$", name)
    return [(f"{m[1]}.{renamed[m[2]]}" if m else name, None)]


def _qwen3_5_mlx_name(name: str) -> list[tuple[str, int | None]]:
    if name == "lm_head":
        return [("language_model.lm_head", None)]
    rest = "language_model.model." + name.removeprefix("model.language_model.")
    m = re.match(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+_proj)$", rest)
    return [(f"{m[1]}.switch_mlp.{m[3]}", int(m[2]))] if m else [(rest, None)]


#: gammas mlx-lm stores as 1 + w (qwen3_5.py sanitize's norm_keys)
_OFFSET = re.compile(r".*(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$|.*\.norm\.weight$")


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_float_tensors_come_back_in_hf_shapes_and_values(converted, name):
    """Every constant the graph reads (conv kernels, A_log, dt_bias, norms) has HF's shape; what
    mlx-lm stored unchanged comes back bit-exact, Qwen3.5's ``1 + w`` gammas as stored - 1."""
    hf_path, mlx_path = converted(name)
    hf_arch = open_architecture(Checkpoint.open(hf_path))
    arch = open_architecture(Checkpoint.open(mlx_path))
    stored = mx.load(str(mlx_path / "model.safetensors"))
    shapes = arch.constant_shapes()
    assert shapes == hf_arch.constant_shapes()
    offsets = 0
    for tensor, shape in shapes.items():
        value, hf_value = arch.checkpoint.weights.tensor(tensor), hf_arch.checkpoint.weights.tensor(tensor).float()
        assert tuple(value.shape) == tuple(shape), tensor
        if name.startswith("qwen3_5") and _OFFSET.match(tensor) and ".linear_attn." not in tensor:
            raw = torch.from_numpy(np.array(stored[_qwen3_5_mlx_name(tensor)[0][0]].astype(mx.float32)))
            assert torch.equal(value, raw - 1.0) and torch.equal(1.0 + value, raw), tensor
            assert (value - hf_value).abs().max() <= 2.0 ** -7, tensor  # 1 + w in bf16: within one ulp in [1, 2)
            offsets += 1
        else:
            assert torch.equal(value.float(), hf_value), tensor
    assert offsets == (0 if name.startswith("lfm2") else 2 * 4 + 2 * 2 + 1)
    kernels = [t for t in shapes if t.endswith(("conv.conv.weight", "conv1d.weight"))]
    assert len(kernels) == 2 and all(shapes[k][1] == 1 for k in kernels)
    for kernel in kernels:  # mlx-lm's [C, K, 1] (the same values in memory order: one axis is 1)
        mlx_name = (_qwen3_5_mlx_name if name.startswith("qwen3_5") else _lfm2_mlx_name)(kernel)[0][0]
        assert tuple(stored[mlx_name].shape) == (shapes[kernel][0], shapes[kernel][2], 1) and shapes[kernel][2] > 1


def test_reshaping_rule_on_a_quantized_tensor_is_refused(converted):
    """A layout that says "float tensor, axes swapped" for what MLX stored quantized: one-line error."""
    _, mlx_path = converted("lfm2")
    layout = MlxLayout((rename_rule(r"model.layers.{layer}.conv.in_proj.weight",
                                    "model.layers.{layer}.conv.in_proj.weight", transpose=True),))
    with pytest.raises(InputError, match=r"model\.layers\.0\.conv\.in_proj\.weight: stored \[192, 8\] quantized"):
        MlxCheckpoint(Checkpoint.open(mlx_path), layout)


def _reference_logits(arch, ids: list[int]) -> np.ndarray:
    with mapped_blocks():
        model = streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights))
        return arch.reference_logits(model, torch.tensor(ids)).numpy()


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_hf_view_is_the_mlx_model(converted, name):
    """The HF model built from the MLX view (what verification's references carry) gives mlx-lm's
    own model's logits, both in fp32 (mlx-lm's run cast to fp32: its scales and biases exactly);
    not vacuous: the same view without the layout's value rules (conv kernels as reshaped, the
    ``1 + w`` gammas as stored) is far off on Qwen3.5."""
    from mlx_lm.utils import load as mlx_load

    _, mlx_path = converted(name)
    ids = [int(i) for i in np.random.RandomState(0).randint(0, 500, 16)]
    model, _ = mlx_load(str(mlx_path))
    model.set_dtype(mx.float32)
    mlx_logits = np.array(model(mx.array(ids)[None]).astype(mx.float32))[0]
    arch = open_architecture(Checkpoint.open(mlx_path))
    assert np.abs(_reference_logits(arch, ids) - mlx_logits).max() < 2e-4
    if name.startswith("qwen3_5"):
        cls = type(arch)
        plain = MlxLayout(tuple(r for r in cls.mlx_layout(arch.checkpoint.config).rules if not r.offset))
        wrong = cls(MlxCheckpoint(Checkpoint.open(mlx_path), plain))
        assert np.abs(_reference_logits(wrong, ids) - mlx_logits).max() > 0.1


def test_text_only_qwen3_5_has_no_mlx_layout(converted, tmp_path):
    """mlx-lm 0.32 has no port of qwen3_5_text: such an MLX folder is refused, naming it."""
    _, mlx_path = converted("qwen3_5")
    folder = shutil.copytree(mlx_path, tmp_path / "text")
    _edit_config(folder, lambda c: c.update(model_type="qwen3_5_text"))
    with pytest.raises(InputError, match=r"text.*qwen3_5_text.*no MLX layout"):
        open_architecture(Checkpoint.open(folder))


#: one end-to-end export per family: name -> (MLX name map, records kept, records left in floats,
#: runtime profile). Qwen3.5-MoE on the exact profile, as its HF MoE export is verified (tests/test_qwen3_5_mnn.py):
#: the fast profile's 8-bit activations move this random model's logits by 3.5 (top-1 71%).
EXPORTS = {"lfm2-moe": (_lfm2_mlx_name, 66, 25, RuntimeProfile.FAST),
           "qwen3_5-moe": (_qwen3_5_mlx_name, 97, 38, RuntimeProfile.EXACT)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_hybrid_mlx_exports_as_stored_and_verifies(converted, tmp_path, name):
    to_mlx, kept, floats, profile = EXPORTS[name]
    _, mlx_path = converted(name)
    result = export(mlx_path, tmp_path / "out", ExportOptions(runtime_profile=profile))
    pre = result.plan.prequantized
    assert not pre.requantized and not pre.quantized_from_float
    transcoded = {linear.name for linear in result.plan.linears if linear.method is QuantMethod.STORED}
    assert len(transcoded) == pre.transcoded == kept and len(pre.kept_float) == floats
    assert _check_records(result.dst, mlx_path, to_mlx, transcoded) == kept

    report = verify_export(result.dst, mlx_path, steps=24)
    print(f"\n{name}: {summary_line(report)}; {pre.transcoded} transcoded, {len(pre.kept_float)} float")
    exact = report.exact_kernels or report.oracle  # the shipped run where the profile is exact
    assert all(step.top1_match for step in exact.per_step)
    assert exact.max_abs_err < 2e-3 and report.passed
    assert report.prequantized["fp32_alpha_records"] == kept
    assert not set(report.prequantized["linears_changed"]) & transcoded
