"""Qwen3.5's vision tower (multimodal ``qwen3_5`` / ``qwen3_5_moe``) -> ``visual.mnn``.

Mirrors transformers 5.x ``Qwen3_5Model.get_image_features`` (modeling_qwen3_5.py
``Qwen3_5VisionModel``): ``Qwen3_5VisionPatchEmbed`` (a Conv3d whose kernel is its stride: one
matrix over each flattened (channel, time, row, column) patch, with bias), plus the learned
``pos_embed`` square sampled bilinearly at the patch grid (vision_utils.py
``get_vision_interpolation_indices_and_weights``, align_corners: four corners and weights per
patch, fed by the runtime as ``idx_tensor`` / ``weight_tensor``), then ``Qwen3_5VisionBlock``s:
LayerNorm (eps 1e-6) -> fused qkv (bias) -> axial 2-D RoPE (``Qwen3_5VisionRotaryEmbedding``:
``head_dim / 4`` frequencies of ``theta``, the row's angles then the column's, repeated for the
rotate-half pairs; applied in fp32) -> full attention (scale head_dim ** -0.5) -> proj, and a
tanh-gelu MLP; finally ``Qwen3_5VisionPatchMerger``: LayerNorm over each patch, the 2x2 merge
block's four patches concatenated, ``linear_fc2(gelu(linear_fc1(x)))`` with the exact (erf) GELU
(``gelu_erf``: MNN's GELU op would compute the tanh approximation).
The output is HF's image features unscaled (Qwen3.5 does not scale its text embeddings).

Qwen3-VL's tower (transformers models/qwen3_vl/modeling_qwen3_vl.py ``Qwen3VLVisionModel``) is
this one plus DeepStack: after each block listed in ``deepstack_visual_indexes`` a merger of its
own (``deepstack_merger_list``, ``use_postshuffle_norm``: the LayerNorm over the 2x2 block's four
patches concatenated, not over each patch) turns the hidden states into one more level of text
embeddings; the graph's second output ``deepstack_embeds`` [levels, tokens, hidden] stacks them
(omni.cpp collects a visual graph's second output for the text graph's ``deepstack_embeds``).

Runtime contract (MNN 3.6.1 omni.cpp ``Omni::qwen2VisionProcess``): inputs ``patches``,
``position_ids``, ``attention_mask``, ``idx_tensor``, ``weight_tensor`` in that order (the runtime
takes patch 16 only then), output ``image_embeds`` [tokens, 1, hidden]; llmexport/media/qwen_vl.py
builds the same inputs. The patch matrix, the position table and the norms are fp32 graph
constants; the blocks' and merger's linears are placeholders, quantized as ``--visual_quant_bit``
says. The attention scales q before ``q @ k`` (gemma3_vision.py: MNN's converter must not fuse it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmexport.errors import InputError
from llmexport.media.qwen_vl import MERGE, TEMPORAL
from llmexport.models.config_values import int_value, str_value
from llmexport.models.gemma3_vision import LayerNorm, placeholder
from llmexport.models.gemma4.towers import TowerLinear, const, encoder_attention, tower_linear
from llmexport.models.tensor_checks import Shapes
from llmexport.models.tensor_names import NameTable
from llmexport.spec import LinearRole
from llmexport.trace.ops import gelu_erf, gelu_tanh

#: the patch size the runtime takes for this input layout (omni.cpp: 16 with ``idx_tensor``)
RUNTIME_PATCH = 16
EPS = 1e-6  # every LayerNorm of the tower (Qwen3_5VisionBlock, Qwen3_5VisionPatchMerger)
INPUTS = ["patches", "position_ids", "attention_mask", "idx_tensor", "weight_tensor"]

VISION = NameTable({
    "patch_embed": "model.visual.patch_embed.proj.weight",  # [hidden, 3, 2, patch, patch]
    "patch_bias": "model.visual.patch_embed.proj.bias",
    "pos_embed": "model.visual.pos_embed.weight",  # [side * side, hidden]
    "norm1.weight": "model.visual.blocks.{layer}.norm1.weight",
    "norm1.bias": "model.visual.blocks.{layer}.norm1.bias",
    "norm2.weight": "model.visual.blocks.{layer}.norm2.weight",
    "norm2.bias": "model.visual.blocks.{layer}.norm2.bias",
    "attn.qkv": "model.visual.blocks.{layer}.attn.qkv",
    "attn.proj": "model.visual.blocks.{layer}.attn.proj",
    "mlp.fc1": "model.visual.blocks.{layer}.mlp.linear_fc1",
    "mlp.fc2": "model.visual.blocks.{layer}.mlp.linear_fc2",
    "merger.norm.weight": "model.visual.merger.norm.weight",
    "merger.norm.bias": "model.visual.merger.norm.bias",
    "merger.fc1": "model.visual.merger.linear_fc1",
    "merger.fc2": "model.visual.merger.linear_fc2",
    # Qwen3-VL's DeepStack mergers, one per level ({layer}: the level)
    "deepstack.norm.weight": "model.visual.deepstack_merger_list.{layer}.norm.weight",
    "deepstack.norm.bias": "model.visual.deepstack_merger_list.{layer}.norm.bias",
    "deepstack.fc1": "model.visual.deepstack_merger_list.{layer}.linear_fc1",
    "deepstack.fc2": "model.visual.deepstack_merger_list.{layer}.linear_fc2",
})
BLOCK_NORMS = ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias")
#: the DeepStack levels MNN 3.6.1's runtime feeds at a decode step (omni.cpp: zeros [3, 1, 1])
MAX_DEEPSTACK = 3
DEEPSTACK_NORMS = ("deepstack.norm.weight", "deepstack.norm.bias")


@dataclass(frozen=True)
class VisionArgs:
    hidden: int
    intermediate: int
    depth: int
    heads: int
    patch: int
    grid_side: int  # num_grid_per_side: the learned position square's side
    out_hidden: int
    theta: float
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: the blocks after which a DeepStack merger reads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patch_width(self) -> int:
        return 3 * TEMPORAL * self.patch * self.patch


def parse_vision_args(config: dict[str, Any], text_hidden: int, where: str,
                      max_layers: int | None = None, deepstack: bool = False) -> VisionArgs:
    """``deepstack``: the tower has Qwen3-VL's ``deepstack_visual_indexes`` (else none is read)."""
    where = f"{where}: vision_config"
    str_value(config, "hidden_act", where, "gelu_pytorch_tanh", ("gelu_pytorch_tanh",))
    for key, value, why in (("in_channels", 3, "the runtime feeds RGB"),
                            ("temporal_patch_size", TEMPORAL, "the runtime's is fixed"),
                            ("spatial_merge_size", MERGE, "the runtime's is fixed"),
                            ("patch_size", RUNTIME_PATCH, "MNN 3.6.1 takes 16 for this tower's inputs")):
        if int_value(config, key, where, value) != value:
            raise InputError(f"{where}: '{key}' must be {value} ({why})")
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InputError(f"{where}: 'rope_parameters' must be an object")
    str_value(rope, "rope_type", f"{where}: rope_parameters", "axial", ("axial",))
    positions = int_value(config, "num_position_embeddings", where)
    side = math.isqrt(positions)
    args = VisionArgs(hidden=int_value(config, "hidden_size", where),
                      intermediate=int_value(config, "intermediate_size", where),
                      depth=int_value(config, "depth", where, maximum=max_layers),
                      heads=int_value(config, "num_heads", where), patch=RUNTIME_PATCH, grid_side=side,
                      out_hidden=int_value(config, "out_hidden_size", where),
                      theta=float(rope.get("rope_theta", 10000.0)),
                      deepstack=_deepstack_indexes(config, where) if deepstack else ())
    if side * side != positions or side < 2:
        raise InputError(f"{where}: 'num_position_embeddings' {positions} must be a square of a side >= 2")
    if args.hidden % args.heads or args.head_dim % 4:
        raise InputError(f"{where}: hidden_size {args.hidden} / num_heads {args.heads} must be a multiple of 4 "
                         "(the axial RoPE's rows and columns)")
    if args.out_hidden != text_hidden:
        raise InputError(f"{where}: 'out_hidden_size' {args.out_hidden} must be the text hidden size {text_hidden}")
    if any(i >= args.depth for i in args.deepstack):
        raise InputError(f"{where}: 'deepstack_visual_indexes' {list(args.deepstack)} must be blocks below "
                         f"depth {args.depth}")
    return args


def _deepstack_indexes(config: dict[str, Any], where: str) -> tuple[int, ...]:
    value = config.get("deepstack_visual_indexes", [8, 16, 24])  # Qwen3VLVisionConfig's default
    if (not isinstance(value, list) or not value or len(set(value)) != len(value)
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)):
        raise InputError(f"{where}: 'deepstack_visual_indexes' must list distinct block indexes (got {value!r})")
    if len(value) > MAX_DEEPSTACK:
        raise InputError(f"{where}: 'deepstack_visual_indexes' has {len(value)} levels; MNN 3.6.1's runtime feeds "
                         f"{MAX_DEEPSTACK} at a decode step")
    return tuple(value)


def vision_linears(args: VisionArgs, weights) -> list[TowerLinear]:
    h, merged = args.hidden, args.hidden * MERGE * MERGE
    out = []
    for i in range(args.depth):
        p = VISION.bind(layer=i)
        for key, fan_in, fan_out, role in (("attn.qkv", h, 3 * h, LinearRole.ATTENTION),
                                           ("attn.proj", h, h, LinearRole.ATTENTION),
                                           ("mlp.fc1", h, args.intermediate, LinearRole.MLP),
                                           ("mlp.fc2", args.intermediate, h, LinearRole.MLP)):
            out.append(tower_linear(weights, p.name(key), fan_in, fan_out, role, False, bias=True))
    out.append(tower_linear(weights, VISION.name("merger.fc1"), merged, merged, LinearRole.MLP, False, bias=True))
    out.append(tower_linear(weights, VISION.name("merger.fc2"), merged, args.out_hidden, LinearRole.MLP, False,
                            bias=True))
    for level in range(len(args.deepstack)):
        out.append(tower_linear(weights, VISION.name("deepstack.fc1", layer=level), merged, merged, LinearRole.MLP,
                                False, bias=True))
        out.append(tower_linear(weights, VISION.name("deepstack.fc2", layer=level), merged, args.out_hidden,
                                LinearRole.MLP, False, bias=True))
    return out


def vision_constants(args: VisionArgs) -> Shapes:
    """Tensors the graph carries as fp32 constants, with their expected shapes."""
    h = args.hidden
    shapes: Shapes = {VISION.name("patch_embed"): (h, 3, TEMPORAL, args.patch, args.patch),
                      VISION.name("patch_bias"): (h,), VISION.name("pos_embed"): (args.grid_side ** 2, h),
                      VISION.name("merger.norm.weight"): (h,), VISION.name("merger.norm.bias"): (h,)}
    for i in range(args.depth):
        shapes.update({name: (h,) for name in VISION.names(BLOCK_NORMS, layer=i)})
    for level in range(len(args.deepstack)):
        shapes.update({name: (h * MERGE * MERGE,) for name in VISION.names(DEEPSTACK_NORMS, layer=level)})
    return shapes


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class _Block(nn.Module):
    """``Qwen3_5VisionBlock``: x + proj(attn(rope(qkv(norm1(x))))), then + fc2(gelu_tanh(fc1(norm2(x))))."""

    def __init__(self, args: VisionArgs, linears: dict[str, TowerLinear], index: int, lookup):
        super().__init__()
        p = VISION.bind(layer=index)
        self.args = args
        self.norm1 = LayerNorm(lookup, p.name("norm1.weight"), p.name("norm1.bias"), EPS)
        self.norm2 = LayerNorm(lookup, p.name("norm2.weight"), p.name("norm2.bias"), EPS)
        self.qkv, self.proj, self.fc1, self.fc2 = (
            placeholder(linears[p.name(key)]) for key in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"))

    def forward(self, x, cos, sin, mask):
        a = self.args
        q, k, v = self.qkv(self.norm1(x)).view(1, -1, 3, a.heads, a.head_dim).unbind(2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + self.proj(encoder_attention(q * a.head_dim ** -0.5, k, v, mask, 1.0))
        return x + self.fc2(gelu_tanh(self.fc1(self.norm2(x))))


class _DeepStackMerger(nn.Module):
    """``Qwen3VLVisionPatchMerger(use_postshuffle_norm=True)`` of one level on [1, patches, hidden]
    -> [1, tokens, out_hidden]: the 2x2 block's patches concatenated, LayerNorm over them, then
    ``linear_fc2(gelu(linear_fc1(x)))`` (exact GELU)."""

    def __init__(self, args: VisionArgs, linears: dict[str, TowerLinear], level: int, lookup):
        super().__init__()
        p = VISION.bind(layer=level)
        self.width = args.hidden * MERGE * MERGE
        self.norm = LayerNorm(lookup, p.name("deepstack.norm.weight"), p.name("deepstack.norm.bias"), EPS)
        self.fc1, self.fc2 = (placeholder(linears[p.name(key)]) for key in ("deepstack.fc1", "deepstack.fc2"))

    def forward(self, x):
        return self.fc2(gelu_erf(self.fc1(self.norm(x.reshape(1, -1, self.width)))))


class QwenVisionGraph(nn.Module):
    """The runtime's five inputs (module docstring) -> image_embeds [tokens, 1, out_hidden], and
    with DeepStack levels (Qwen3-VL) deepstack_embeds [levels, tokens, out_hidden]."""

    inv_freq: torch.Tensor

    def __init__(self, args: VisionArgs, linears: list[TowerLinear], lookup):
        super().__init__()
        by_name = {linear.spec.name: linear for linear in linears}
        self.args = args
        self.patch_weight = nn.Parameter(lookup(VISION.name("patch_embed")).float().reshape(args.hidden, -1).clone(),
                                         requires_grad=False)
        self.patch_bias = const(lookup, VISION.name("patch_bias"))
        self.pos_embed = const(lookup, VISION.name("pos_embed"))
        self.blocks = nn.ModuleList(_Block(args, by_name, i, lookup) for i in range(args.depth))
        self.merger_norm = LayerNorm(lookup, VISION.name("merger.norm.weight"), VISION.name("merger.norm.bias"), EPS)
        self.merger_fc1 = placeholder(by_name[VISION.name("merger.fc1")])
        self.merger_fc2 = placeholder(by_name[VISION.name("merger.fc2")])
        if args.deepstack:
            self.deepstack = nn.ModuleList(_DeepStackMerger(args, by_name, level, lookup)
                                           for level in range(len(args.deepstack)))
        spatial = args.head_dim // 2  # Qwen3_5VisionRotaryEmbedding.compute_axial_rope_parameters
        inv_freq = 1.0 / (args.theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, patches, position_ids, attention_mask, idx_tensor, weight_tensor):
        a = self.args
        x = torch.matmul(patches, self.patch_weight.t()) + self.patch_bias  # [n, hidden]
        corners = F.embedding(idx_tensor.long(), self.pos_embed)  # [4, n, hidden]
        x = (x + (corners * weight_tensor.unsqueeze(-1)).sum(0)).unsqueeze(0)
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq  # [2, n, head_dim / 4]
        angles = torch.cat([freqs[0], freqs[1]], dim=-1)
        emb = torch.cat([angles, angles], dim=-1).view(1, -1, 1, a.head_dim)
        cos, sin = emb.cos(), emb.sin()
        mask = attention_mask.unsqueeze(1)  # [1, 1, n, n]
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            if i in a.deepstack:
                levels.append(self.deepstack[a.deepstack.index(i)](x))
        # [1, rows, 4 * hidden]: rank 3, as the runtime's rebuilt linears give it (mnn/rebuild.py)
        merged = self.merger_norm(x).reshape(1, -1, a.hidden * MERGE * MERGE)
        out = self.merger_fc2(gelu_erf(self.merger_fc1(merged)))
        out = out.reshape(-1, 1, a.out_hidden)  # the runtime's [rows, 1, hidden]
        return (out, torch.cat(levels)) if levels else out
