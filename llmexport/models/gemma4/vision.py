"""Gemma4 vision tower -> ``visual.mnn``.

Mirrors transformers 5.x ``Gemma4VisionModel`` + ``Gemma4MultimodalEmbedder``
(modeling_gemma4.py): patch embedding (``2(x - 0.5)``, linear, learned x/y position tables),
a bidirectional ViT encoder with 2-D RoPE and q/k/v norms, the 3x3 position pooler scaled by
sqrt(hidden), optional standardisation, then RMSNorm (no scale) and the projection into the text
hidden size. Trace-friendly: no ``unfold``, no boolean indexing; the pooler is a one-hot matmul
over kernel indices computed from the position ids, so the graph has no data-dependent shape.

Runtime contract (MNN 3.6.1 omni.cpp ``gemma4VisionProcess``): inputs ``input_patches`` float
[1, N, 768] and ``image_position_ids`` int32 [1, N, 2] (x, y; -1 padding), N = 2520 padded;
output ``image_embeds`` [1, N/9, text_hidden], of which the runtime keeps the first real rows and
multiplies them by a hard-coded 1/39.25 before the text graph scales by sqrt(text_hidden). The
exported graph multiplies its output by 39.25 / sqrt(text_hidden) so the product is exactly 1,
and, when image spans attend bidirectionally, by the media mark the text graph looks for
(media.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmexport.errors import InputError
from llmexport.media.image import processed_size, synthetic_image
from llmexport.models.config_values import flag_value, float_value, int_value, str_value
from llmexport.models.gemma4.media import MEDIA_MARK
from llmexport.models.gemma4.names import VISION, VISION_ATTENTION, VISION_MLP, VISION_NORMS
from llmexport.models.gemma4.tower_checks import hf_processor, media_prompt, tower_check
from llmexport.models.gemma4.towers import (
    ClippedLinear,
    Gemma4Tower,
    TokenTail,
    TowerLinear,
    const,
    encoder_attention,
    tower_linear,
)
from llmexport.models.tensor_checks import Shapes, finite_lookup
from llmexport.models.tensor_names import NameTable
from llmexport.models.tower_check import FeatureCase, Measure, PromptCase, TowerCheck
from llmexport.spec import GraphInputs, LinearRole
from llmexport.trace.ops import gelu_tanh, rms_norm

log = logging.getLogger(__name__)

RUNTIME_IMAGE_SCALE = 1.0 / 39.25  # omni.cpp gemma4VisionProcess: imageEmbedding * (1.0f / 39.25f)
VERIFY_SIZES = ((300, 300), (200, 640), (317, 451))  # square, wide, sides not multiples of 48
FEATURE_BOUND = 1e-3  # max relative error of visual.mnn vs HF image features (stored weights)
# the token ids the runtime keys name, under their Gemma4Config keys
VISION_TOKENS: dict[str, tuple[str, ...]] = {key: (key,) for key in ("boi_token_id", "eoi_token_id", "image_token_id")}
QUESTION = "Describe this picture in a few words."  # the user's words after the image
PROMPT_TAIL = QUESTION + "<turn|>\n<|turn>model\n"


@dataclass(frozen=True)
class VisionArgs:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    patch: int
    pooling: int
    position_size: int
    clipped: bool
    standardize: bool
    text_hidden: int

    @property
    def output_scale(self) -> float:
        """Multiplier that undoes the runtime's 1/39.25 for this text hidden size."""
        return 1.0 / (RUNTIME_IMAGE_SCALE * math.sqrt(self.text_hidden))


def parse_vision_args(config: dict[str, Any], text_hidden: int, where: str,
                      max_layers: int | None = None) -> VisionArgs:
    where = f"{where}: vision_config"
    rope = config.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 100.0}
    if not isinstance(rope, dict):
        raise InputError(f"{where}: 'rope_parameters' must be an object")
    str_value(rope, "rope_type", where, "axial", ("axial",))
    str_value(config, "hidden_activation", where, "gelu_pytorch_tanh", ("gelu_pytorch_tanh",))
    heads = int_value(config, "num_attention_heads", where)
    args = VisionArgs(
        hidden=int_value(config, "hidden_size", where), intermediate=int_value(config, "intermediate_size", where),
        layers=int_value(config, "num_hidden_layers", where, maximum=max_layers), heads=heads,
        kv_heads=int_value(config, "num_key_value_heads", where, heads),
        head_dim=int_value(config, "head_dim", where), eps=float_value(config, "rms_norm_eps", where, 1e-6, high=1.0),
        rope_theta=float_value(rope, "rope_theta", where, 100.0), patch=int_value(config, "patch_size", where, 16),
        pooling=int_value(config, "pooling_kernel_size", where, 3),
        position_size=int_value(config, "position_embedding_size", where),
        clipped=flag_value(config, "use_clipped_linears", where, False),
        standardize=flag_value(config, "standardize", where, False), text_hidden=text_hidden)
    if args.head_dim % 4:
        raise InputError(f"{where}: head_dim {args.head_dim} must be a multiple of 4 (2-D RoPE)")
    if heads % args.kv_heads:
        raise InputError(f"{where}: {heads} heads are not a multiple of {args.kv_heads} KV heads")
    if (args.patch, args.pooling) != (16, 3):
        raise InputError(f"{where}: MNN's runtime patchifies 16x16 and pools 3x3; the checkpoint has "
                         f"patch {args.patch}, pooling {args.pooling}")
    return args


def vision_linears(args: VisionArgs, weights) -> list[TowerLinear]:
    h, d = args.hidden, args.head_dim
    out = [tower_linear(weights, VISION.name("input_proj"), 3 * args.patch ** 2, h, LinearRole.MLP, False)]
    for i in range(args.layers):
        for key, fan_in, fan_out, role in (
                ("self_attn.q_proj", h, args.heads * d, LinearRole.ATTENTION),
                ("self_attn.k_proj", h, args.kv_heads * d, LinearRole.ATTENTION),
                ("self_attn.v_proj", h, args.kv_heads * d, LinearRole.ATTENTION),
                ("self_attn.o_proj", args.heads * d, h, LinearRole.ATTENTION),
                ("mlp.gate_proj", h, args.intermediate, LinearRole.MLP),
                ("mlp.up_proj", h, args.intermediate, LinearRole.MLP),
                ("mlp.down_proj", args.intermediate, h, LinearRole.MLP)):
            out.append(tower_linear(weights, VISION.name(key, layer=i), fan_in, fan_out, role, True, args.clipped))
    out.append(tower_linear(weights, VISION.name("embedding_projection"), h, args.text_hidden, LinearRole.MLP, False))
    return out


def vision_constants(args: VisionArgs) -> Shapes:
    """Small tensors the graph carries as constants, with their expected shapes."""
    names: Shapes = {VISION.name("position_table"): (2, args.position_size, args.hidden)}
    for i in range(args.layers):
        names.update({name: (args.hidden,) for name in VISION.names(VISION_NORMS, layer=i)})
        names.update({name: (args.head_dim,) for name in VISION.names(("self_attn.q_norm", "self_attn.k_norm"),
                                                                      layer=i)})
    if args.standardize:
        names.update({name: (args.hidden,) for name in VISION.names(("std_bias", "std_scale"))})
    return names


# --- the trace-friendly graph ------------------------------------------------------------------
def _rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_multidimensional_rope`` with 2 axes: each half of the head is rotated (rotate-half)
    by its own axis' angles. x [1, N, heads, D]; cos/sin [1, N, 1, D]."""
    half, quarter = x.shape[-1] // 2, x.shape[-1] // 4
    parts = []
    for k in range(2):
        xk = x[..., k * half:(k + 1) * half]
        rotated = torch.cat([-xk[..., quarter:], xk[..., :quarter]], dim=-1)
        parts.append(xk * cos[..., k * half:(k + 1) * half] + rotated * sin[..., k * half:(k + 1) * half])
    return torch.cat(parts, dim=-1)


class _Attention(nn.Module):
    """``names``: the tower's name table bound to the layer (also for ``_EncoderLayer``)."""

    def __init__(self, args: VisionArgs, linears: dict[str, TowerLinear], names: NameTable, lookup):
        super().__init__()
        self.args = args
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            ClippedLinear(linears[name]) for name in names.names(VISION_ATTENTION))
        self.q_norm = const(lookup, names.name("self_attn.q_norm"))
        self.k_norm = const(lookup, names.name("self_attn.k_norm"))

    def forward(self, x, cos, sin, mask):
        a = self.args
        q = _rope_2d(rms_norm(self.q_proj(x).view(1, -1, a.heads, a.head_dim), self.q_norm, a.eps), cos, sin)
        k = _rope_2d(rms_norm(self.k_proj(x).view(1, -1, a.kv_heads, a.head_dim), self.k_norm, a.eps), cos, sin)
        v = rms_norm(self.v_proj(x).view(1, -1, a.kv_heads, a.head_dim), None, a.eps)
        # Bidirectional, scale 1.0 (q/k are RMS-normalised); padding keys are masked.
        return self.o_proj(encoder_attention(q, k, v, mask, 1.0))


class _EncoderLayer(nn.Module):
    def __init__(self, args: VisionArgs, linears: dict[str, TowerLinear], index: int, lookup):
        super().__init__()
        p = VISION.bind(layer=index)
        self.eps = args.eps
        self.norms = nn.ParameterDict({key: const(lookup, p.name(key)) for key in VISION_NORMS})
        self.self_attn = _Attention(args, linears, p, lookup)
        self.gate_proj, self.up_proj, self.down_proj = (ClippedLinear(linears[name]) for name in p.names(VISION_MLP))

    def forward(self, x, cos, sin, mask):
        n = self.norms
        x = x + rms_norm(self.self_attn(rms_norm(x, n["input_layernorm"], self.eps), cos, sin, mask),
                         n["post_attention_layernorm"], self.eps)
        h = rms_norm(x, n["pre_feedforward_layernorm"], self.eps)
        h = self.down_proj(gelu_tanh(self.gate_proj(h)) * self.up_proj(h))
        return x + rms_norm(h, n["post_feedforward_layernorm"], self.eps)


class VisionGraph(nn.Module):
    """input_patches [1, N, 3*16*16] in [0, 1], image_position_ids int [1, N, 2] (x, y; -1 padding)
    -> image_embeds [1, N/9, text_hidden] (pooled tokens in row-major pooled-grid order, then the
    padding tokens), multiplied by ``output_scale``."""

    inv_freq: torch.Tensor

    def __init__(self, args: VisionArgs, linears: list[TowerLinear], lookup, output_scale: float = 1.0,
                 token_tail: torch.Tensor | None = None, tail_scale: float = 1.0):
        super().__init__()
        by_name = {linear.spec.name: linear for linear in linears}
        self.args = args
        self.out = TokenTail(token_tail, output_scale, tail_scale)
        self.input_proj = ClippedLinear(by_name[VISION.name("input_proj")])
        self.position_table = const(lookup, VISION.name("position_table"))
        self.layers = nn.ModuleList(_EncoderLayer(args, by_name, i, lookup) for i in range(args.layers))
        spatial = args.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (args.rope_theta ** (torch.arange(0, spatial, 2).float() / spatial)),
                             persistent=False)
        if args.standardize:
            self.std_bias = const(lookup, VISION.name("std_bias"))
            self.std_scale = const(lookup, VISION.name("std_scale"))
        self.embedding_projection = ClippedLinear(by_name[VISION.name("embedding_projection")])

    def _rope(self, positions: torch.Tensor):
        # HF Gemma4VisionRotaryEmbedding: angles of x and y, laid out [x, x, y, y] over the head.
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [1, N, 2, D/4]
        fx, fy = freqs[:, :, 0], freqs[:, :, 1]
        emb = torch.cat([fx, fx, fy, fy], dim=-1).unsqueeze(2)
        return emb.cos(), emb.sin()

    def _pool(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """HF Gemma4VisionPooler._avg_pool_by_positions as a one-hot matmul: patch (x, y) goes to
        pooled token floor(x/k) + (width/k) * floor(y/k), width = max x + 1."""
        k = self.args.pooling
        clamped = positions.clamp(min=0)
        width = clamped[..., 0].max(dim=-1, keepdim=True)[0] + 1
        # Non-negative operands: truncating division is floor division (and one ONNX Div).
        kernel = torch.div(clamped[..., 0], k, rounding_mode="trunc") + \
            torch.div(width, k, rounding_mode="trunc") * torch.div(clamped[..., 1], k, rounding_mode="trunc")
        slots = torch.arange(hidden.shape[1] // (k * k), dtype=kernel.dtype)
        weights = (kernel.unsqueeze(-1) == slots).float() * (1.0 / (k * k))  # [1, N, N/k^2]
        return torch.matmul(weights.transpose(1, 2), hidden.float())

    def forward(self, input_patches, image_position_ids):
        a = self.args
        positions = image_position_ids.long()
        padding = ((positions[..., 0] == -1) & (positions[..., 1] == -1)).unsqueeze(-1)  # [1, N, 1]
        x = self.input_proj(2.0 * (input_patches - 0.5))
        clamped = positions.clamp(min=0)
        pos_emb = F.embedding(clamped[..., 0], self.position_table[0]) + F.embedding(clamped[..., 1],
                                                                                     self.position_table[1])
        x = x + torch.where(padding, torch.zeros_like(pos_emb), pos_emb)
        lowest = torch.finfo(torch.float32).min
        mask = torch.where(padding, lowest, 0.0).view(1, 1, 1, -1)
        cos, sin = self._rope(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = torch.where(padding, torch.zeros_like(x), x)
        pooled = self._pool(x, positions) * math.sqrt(a.hidden)
        if a.standardize:
            pooled = (pooled - self.std_bias) * self.std_scale
        return self.out(self.embedding_projection(rms_norm(pooled, None, a.eps)))


def trace_positions(grid_h: int, grid_w: int, pad: int) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    pos = torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)
    return torch.cat([pos, torch.full((pad, 2), -1)]).to(torch.int32).unsqueeze(0)


class Gemma4VisionTower(Gemma4Tower):
    name = "visual"

    def __init__(self, arch, vision_config: dict[str, Any]):
        super().__init__(arch, vision_config, parse_vision_args, vision_linears, VISION_TOKENS, "a vision")

    # --- weights ----------------------------------------------------------------------------
    def expected_tensors(self) -> Shapes:
        """Every checkpoint tensor this tower reads (name -> shape, None: scalar buffer)."""
        return {**vision_constants(self.args), **self.linear_tensors(self.args.clipped)}

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self, token_tail: torch.Tensor | None = None, output_scale: float | None = None) -> nn.Module:
        scale = self.output_scale if output_scale is None else output_scale
        # The tail meets the runtime's 1/39.25 and the text graph's unmarking, not sqrt(hidden).
        tail_scale = (MEDIA_MARK if self.arch.marks_images else 1.0) / RUNTIME_IMAGE_SCALE
        return VisionGraph(self.args, self._linears, finite_lookup(self.checkpoint.weights, self.checkpoint.path),
                           scale, token_tail, tail_scale).eval()

    def graph_inputs(self) -> GraphInputs:
        positions = trace_positions(6, 6, 9)  # 36 real patches + 9 padding, traced with dynamic N
        patches = torch.rand(1, positions.shape[1], 3 * self.args.patch ** 2)
        return GraphInputs((patches, positions), ["input_patches", "image_position_ids"],
                           {"input_patches": {1: "num_patches"}, "image_position_ids": {1: "num_patches"}},
                           ["image_embeds"])

    # --- runtime files ----------------------------------------------------------------------
    def llm_config(self) -> dict[str, Any]:
        return {"is_visual": True, "visual_model": "visual.mnn",
                # The graph rescales to [0, 1]; the runtime's own mean/norm are overridden with these.
                "image_mean": [0.0, 0.0, 0.0], "image_norm": [1.0 / 255] * 3,
                # Default size when a prompt has no <hw>: HF's processed size of a square image.
                "image_size": 768,
                "vision_start": self.ids["boi_token_id"], "vision_end": self.ids["eoi_token_id"],
                "image_pad": self.ids["image_token_id"]}

    # --- verification -----------------------------------------------------------------------
    @property
    def output_scale(self) -> float:
        """What ``visual.mnn`` multiplies HF's image features by: the runtime-scale compensation,
        times the media mark when image spans attend bidirectionally (media.py)."""
        return self.args.output_scale * (MEDIA_MARK if self.arch.marks_images else 1.0)

    def check(self, prompt_sizes: tuple[tuple[int, int], ...] = (VERIFY_SIZES[-1],)) -> TowerCheck:
        """``visual.mnn`` on HF's exact patches of ``VERIFY_SIZES`` vs HF's image features (stored
        weights: max relative error < 1e-3; fp32 weights: reported), and an image+text prompt per
        ``prompt_sizes`` through the runtime (image given by ``save_image_for_runtime``) vs HF's full model."""
        processor = hf_processor(self.checkpoint.path)
        processed = [processor.image_processor(images=[synthetic_image(h, w, seed=h + w)], return_tensors="pt")
                     for h, w in VERIFY_SIZES]
        feeds = [{"input_patches": p["pixel_values"].numpy(),
                  "image_position_ids": p["image_position_ids"].numpy().astype(np.int32)} for p in processed]
        cases = tuple(FeatureCase(f"image {[h, w]}", feed, {"size": [h, w], "processed": list(processed_size(h, w))})
                      for (h, w), feed in zip(VERIFY_SIZES, feeds))
        prompts = []
        for h, w in prompt_sizes:
            inputs, runtime_text = media_prompt(processor, "images", synthetic_image(h, w, seed=h + w + 1), PROMPT_TAIL)
            soft_tokens = inputs["input_ids"][0].tolist().count(self.ids["image_token_id"])
            prompts.append(PromptCase(f"{h}x{w}", f"image prompt {h}x{w}", inputs, runtime_text,
                                      {"image": [h, w], "processed": list(processed_size(h, w)),
                                       "soft_tokens": soft_tokens}, QUESTION))
        return tower_check(
            self.arch, processor, output="image_embeds", cases=cases, cases_key="images",
            features=lambda model: [image_features(model, p["pixel_values"], p["image_position_ids"])
                                    for p in processed],
            measures={"soft_tokens": Measure.ROWS, "rel_err": Measure.REL_ERR, "max_abs_err": Measure.MAX_ABS_ERR,
                      "rel_err_fp32": Measure.REL_ERR_FP32},
            feature_bound=FEATURE_BOUND, prompts=tuple(prompts), output_scale=self.output_scale,
            feature_columns=self.feature_columns, keeps_first_rows=True,
            notes={"output_scale": self.output_scale, "marks_images": self.arch.marks_images})


def image_features(model, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF's image soft tokens [n, text_hidden] (``Gemma4Model.get_image_features``, padding stripped)."""
    with torch.no_grad():
        return torch.cat(model.model.get_image_features(pixel_values, positions).pooler_output).float()
