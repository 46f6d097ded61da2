"""Gemma4 audio tower (USM Conformer) -> ``audio.mnn``.

Mirrors transformers 5.x ``Gemma4AudioModel`` + ``Gemma4MultimodalEmbedder`` (modeling_gemma4.py):
two stride-2 3x3 convolutions with channel LayerNorm and ReLU, a linear projection, Conformer
blocks (half-step FFN, chunked local self-attention with relative positions and logit
soft-capping, GLU + causal depthwise convolution, half-step FFN, RMSNorm), the output projection,
then RMSNorm (no scale) and the projection into the text hidden size.

The chunked attention is rebuilt for tracing: HF pads and ``unfold``s keys/values into
overlapping blocks; here each block's context is an index GATHER (block starts x offsets,
clamped into the sequence) and positions outside the sequence or the window are masked, so the
ONNX graph has no padding that depends on the length. The relative-position term uses a constant
table (``relative_k_proj`` applied to HF's sinusoids, laid out per (query, key) offset), which
replaces HF's pad-and-reshape ``_rel_shift``.

Runtime contract (MNN 3.6.1 omni.cpp ``audioProcess``, audio_type "usm"): one input
``input_features`` [1, T, 128] (no mask), output ``audio_embeds`` [1, ceil(ceil(T/2)/2), hidden],
which the runtime multiplies by 1/sqrt(hidden) before the text graph multiplies by sqrt(hidden).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmexport.errors import InputError
from llmexport.media.audio import (
    MELS,
    RUNTIME_TAIL,
    hf_frame_count,
    runtime_frame_count,
    samples_for_tokens,
    synthetic_clip,
)
from llmexport.models.config_values import FP32_MAX, flag_value, float_value, int_value, str_value
from llmexport.models.gemma4.names import AUDIO, AUDIO_ATTENTION, AUDIO_LAYER_NORMS, AUDIO_NORMS
from llmexport.models.gemma4.tower_checks import hf_processor, media_prompt, tower_check
from llmexport.models.gemma4.towers import ClippedLinear, Gemma4Tower, TokenTail, TowerLinear, const, tower_linear
from llmexport.models.tensor_checks import Shapes, finite_lookup
from llmexport.models.tensor_names import NameTable
from llmexport.models.tower_check import FeatureCase, Measure, PromptCase, TowerCheck
from llmexport.spec import GraphInputs, LinearRole
from llmexport.trace.ops import rms_norm

log = logging.getLogger(__name__)

FEATURE_BOUND = 1e-3  # max relative error of audio.mnn vs HF audio features (stored weights)
# transformers names the end-of-audio id "eoa_token_index" (Gemma4Config)
AUDIO_TOKENS = {"boa": ("boa_token_id",), "eoa": ("eoa_token_index", "eoa_token_id"), "audio": ("audio_token_id",)}
QUESTION = "Transcribe this audio."  # the user's words after the clip
PROMPT_TAIL = QUESTION + "<turn|>\n<|turn>model\n"


@dataclass(frozen=True)
class AudioArgs:
    hidden: int
    layers: int
    heads: int
    channels: tuple[int, int]
    conv_kernel: int
    residual_weight: float
    chunk: int
    context_left: int
    context_right: int
    logit_cap: float
    invalid_logit: float
    clipped: bool
    eps: float
    gradient_clipping: float
    output_dims: int
    text_hidden: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def past(self) -> int:
        """HF ``max_past_horizon``: keys before the block start that a block's context holds."""
        return self.context_left - 1

    @property
    def context(self) -> int:
        return self.chunk + self.past + self.context_right

    @property
    def rel_positions(self) -> int:
        """Rows of HF's relative position table (``Gemma4AudioRelPositionalEncoding``)."""
        return self.context // 2 + 1

    @property
    def freq_bins(self) -> int:
        """Mel bins left after the two stride-2 convolutions (128 -> 64 -> 32)."""
        return (((MELS - 1) // 2 + 1) - 1) // 2 + 1


def parse_audio_args(config: dict[str, Any], text_hidden: int, where: str, max_layers: int | None = None) -> AudioArgs:
    where = f"{where}: audio_config"
    channels = config.get("subsampling_conv_channels", [128, 32])
    if not isinstance(channels, list) or len(channels) != 2 or \
            not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in channels):
        raise InputError(f"{where}: 'subsampling_conv_channels' must be two positive integers, got {channels!r}")
    str_value(config, "hidden_act", where, "silu", ("silu",))
    hidden = int_value(config, "hidden_size", where)
    args = AudioArgs(
        hidden=hidden, layers=int_value(config, "num_hidden_layers", where, maximum=max_layers),
        heads=int_value(config, "num_attention_heads", where),
        channels=(channels[0], channels[1]), conv_kernel=int_value(config, "conv_kernel_size", where, 5),
        residual_weight=float_value(config, "residual_weight", where, 0.5),
        chunk=int_value(config, "attention_chunk_size", where, 12),
        context_left=int_value(config, "attention_context_left", where, 13),
        context_right=int_value(config, "attention_context_right", where, 0, minimum=0),
        logit_cap=float_value(config, "attention_logit_cap", where, 50.0),
        invalid_logit=float_value(config, "attention_invalid_logits_value", where, -1e9, low=-FP32_MAX, high=0.0),
        clipped=flag_value(config, "use_clipped_linears", where, True),
        eps=float_value(config, "rms_norm_eps", where, 1e-6, high=1.0),
        gradient_clipping=float_value(config, "gradient_clipping", where, 1e10),
        output_dims=int_value(config, "output_proj_dims", where, hidden), text_hidden=text_hidden)
    if args.hidden % args.heads:
        raise InputError(f"{where}: audio hidden_size {args.hidden} is not a multiple of {args.heads} heads")
    # HF sizes input_proj_linear as (channels[0] // 4) * channels[1]; the flattened conv output is
    # (128 mel bins / 4) * channels[1]: the two agree only when channels[0] // 4 == 32.
    if args.channels[0] // 4 != args.freq_bins:
        raise InputError(f"{where}: subsampling_conv_channels[0] is {args.channels[0]}; HF's layout needs "
                         f"channels[0] // 4 == {args.freq_bins} (128 mel bins after two stride-2 convolutions)")
    if args.context_left < 2:
        raise InputError(f"{where}: attention_context_left must be >= 2")
    return args


def audio_linears(args: AudioArgs, weights) -> list[TowerLinear]:
    h = args.hidden
    out = [tower_linear(weights, AUDIO.name("subsample.input_proj_linear"), args.freq_bins * args.channels[1], h,
                        LinearRole.MLP, False)]
    for i in range(args.layers):
        for key, fan_in, fan_out, role in (
                ("feed_forward1.ffw_layer_1", h, 4 * h, LinearRole.MLP),
                ("feed_forward1.ffw_layer_2", 4 * h, h, LinearRole.MLP),
                ("self_attn.q_proj", h, h, LinearRole.ATTENTION), ("self_attn.k_proj", h, h, LinearRole.ATTENTION),
                ("self_attn.v_proj", h, h, LinearRole.ATTENTION), ("self_attn.post", h, h, LinearRole.ATTENTION),
                ("lconv1d.linear_start", h, 2 * h, LinearRole.MLP), ("lconv1d.linear_end", h, h, LinearRole.MLP),
                ("feed_forward2.ffw_layer_1", h, 4 * h, LinearRole.MLP),
                ("feed_forward2.ffw_layer_2", 4 * h, h, LinearRole.MLP)):
            out.append(tower_linear(weights, AUDIO.name(key, layer=i), fan_in, fan_out, role, True, args.clipped))
    out.append(tower_linear(weights, AUDIO.name("output_proj"), h, args.output_dims, LinearRole.MLP, False, bias=True))
    out.append(tower_linear(weights, AUDIO.name("embedding_projection"), args.output_dims, args.text_hidden,
                            LinearRole.MLP, False))
    return out


def audio_constants(args: AudioArgs) -> Shapes:
    h, (c0, c1) = args.hidden, args.channels
    names: Shapes = {AUDIO.name("subsample.layer0.conv"): (c0, 1, 3, 3), AUDIO.name("subsample.layer0.norm"): (c0,),
                     AUDIO.name("subsample.layer1.conv"): (c1, c0, 3, 3), AUDIO.name("subsample.layer1.norm"): (c1,)}
    for i in range(args.layers):
        p = AUDIO.bind(layer=i)
        names.update({name: (h,) for name in p.names(AUDIO_NORMS)})
        names[p.name("self_attn.per_dim_scale")] = (args.head_dim,)
        names[p.name("self_attn.relative_k_proj")] = (h, h)
        names[p.name("lconv1d.depthwise_conv1d")] = (h, 1, args.conv_kernel)
    return names


# --- chunked local attention: gather formulation ---------------------------------------------------
def relative_position_table(args: AudioArgs, relative_k_proj: torch.Tensor) -> torch.Tensor:
    """[heads, chunk, D, context]: the relative-key vector each (query c, context slot o) pair uses.

    HF computes ``q @ relative_k_proj(sinusoids)^T`` over ``rel_positions`` rows (row p: distance
    context//2 - p) and ``_rel_shift``s it so that slot o of query c reads row o - c (zeros past the
    table). Laying the rows out per (c, o) once turns that into one matmul with a constant.
    """
    # Gemma4AudioRelPositionalEncoding: [sin, cos] of positions context//2 .. 0.
    half = args.hidden // 2
    increment = math.log(10000.0) / max(half - 1, 1)
    inv = torch.exp(torch.arange(half) * -increment).view(1, 1, -1)
    positions = torch.arange(args.context // 2, -1, -1).view(-1, 1)
    scaled = positions * inv
    sinusoids = torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1).float()
    rel = F.linear(sinusoids, relative_k_proj.float()).view(args.rel_positions, args.heads, args.head_dim)
    shift = torch.arange(args.context).view(1, -1) - torch.arange(args.chunk).view(-1, 1)  # o - c
    valid = (shift >= 0) & (shift < args.rel_positions)
    table = rel[shift.clamp(0, args.rel_positions - 1)] * valid[..., None, None]  # [C, ctx, H, D]
    return table.permute(2, 0, 3, 1).contiguous()


def window_mask(args: AudioArgs) -> torch.Tensor:
    """[chunk, context] bool: key slot o is in query c's window (HF ``sliding_window_mask_function``
    with (context_left - 1, context_right)). Query c sits at slot c + past; dist = query - key."""
    dist = torch.arange(args.chunk).view(-1, 1) + args.past - torch.arange(args.context).view(1, -1)
    return ((dist >= 0) & (dist < args.past)) | ((dist < 0) & (-dist < args.context_right))


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_table: torch.Tensor,
                      window: torch.Tensor, args: AudioArgs) -> torch.Tensor:
    """Blocked local attention; q, k, v [T, heads, D] (q/k already scaled) -> [T, heads * D].

    Block b holds queries b*C .. b*C+C-1; its context slots o hold keys b*C - past + o. Both are
    gathered with indices clamped into [0, T); keys outside the sequence are masked like HF's
    padding (``attention_invalid_logits_value`` after soft-capping), queries past T are dropped.
    """
    length, c, ctx = q.shape[0], args.chunk, args.context
    blocks = (length + c - 1) // c
    starts = torch.arange(blocks).view(-1, 1) * c
    q_index = (starts + torch.arange(c).view(1, -1)).clamp(max=length - 1)  # [nb, C]
    k_abs = starts + torch.arange(ctx).view(1, -1) - args.past  # [nb, ctx]
    k_index = k_abs.clamp(0, length - 1)
    qb = q.index_select(0, q_index.reshape(-1)).view(blocks, c, args.heads, args.head_dim).permute(2, 0, 1, 3)
    kb = k.index_select(0, k_index.reshape(-1)).view(blocks, ctx, args.heads, args.head_dim).permute(2, 0, 3, 1)
    vb = v.index_select(0, k_index.reshape(-1)).view(blocks, ctx, args.heads, args.head_dim).permute(2, 0, 1, 3)
    content = torch.matmul(qb, kb)  # [H, nb, C, ctx]
    position = torch.matmul(qb.transpose(1, 2), rel_table).transpose(1, 2)  # [H, C, nb, D] @ [H, C, D, ctx]
    logits = torch.tanh((content + position) / args.logit_cap) * args.logit_cap
    inside = (k_abs >= 0) & (k_abs < length)
    valid = window.view(1, c, ctx) & inside.view(blocks, 1, ctx)  # [nb, C, ctx]
    logits = torch.where(valid, logits, torch.full_like(logits, args.invalid_logit))
    out = torch.matmul(torch.softmax(logits, dim=-1), vb)  # [H, nb, C, D]
    out = out.permute(1, 2, 0, 3).reshape(blocks * c, args.hidden)
    return out[:length]


# --- the trace-friendly graph ---------------------------------------------------------------------
class _Attention(nn.Module):
    """``names``: the tower's name table bound to the layer (also for the classes below)."""

    q_scale: torch.Tensor
    rel_table: torch.Tensor
    window: torch.Tensor

    def __init__(self, args: AudioArgs, linears: dict[str, TowerLinear], names: NameTable, lookup):
        super().__init__()
        self.args = args
        self.q_proj, self.k_proj, self.v_proj, self.post = (
            ClippedLinear(linears[name]) for name in names.names(AUDIO_ATTENTION))
        # HF: q * head_dim^-0.5 / ln 2 * softplus(per_dim_scale); k * ln(1 + e) / ln 2.
        q_scale = (args.head_dim ** -0.5) / math.log(2) * F.softplus(lookup(names.name("self_attn.per_dim_scale"))
                                                                      .float())
        self.register_buffer("q_scale", q_scale, persistent=False)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        table = relative_position_table(args, lookup(names.name("self_attn.relative_k_proj")))
        self.register_buffer("rel_table", table, persistent=False)
        self.register_buffer("window", window_mask(args), persistent=False)

    def forward(self, x):
        a = self.args
        q = self.q_proj(x).view(-1, a.heads, a.head_dim) * self.q_scale
        k = self.k_proj(x).view(-1, a.heads, a.head_dim) * self.k_scale
        v = self.v_proj(x).view(-1, a.heads, a.head_dim)
        out = chunked_attention(q, k, v, self.rel_table, self.window, a)
        return self.post(out.view(1, -1, a.hidden))


class _FeedForward(nn.Module):
    """``part``: "feed_forward1" or "feed_forward2" (the keys of its tensors)."""

    def __init__(self, args: AudioArgs, linears: dict[str, TowerLinear], names: NameTable, part: str, lookup):
        super().__init__()
        self.args = args
        self.pre = const(lookup, names.name(part + ".pre_layer_norm"))
        self.post = const(lookup, names.name(part + ".post_layer_norm"))
        self.ffw_layer_1 = ClippedLinear(linears[names.name(part + ".ffw_layer_1")])
        self.ffw_layer_2 = ClippedLinear(linears[names.name(part + ".ffw_layer_2")])

    def forward(self, x):
        a = self.args
        h = rms_norm(_clip(x, a), self.pre, a.eps)
        h = _clip(self.ffw_layer_2(F.silu(self.ffw_layer_1(h))), a)
        return rms_norm(h, self.post, a.eps) * a.residual_weight + x


class _LightConv(nn.Module):
    def __init__(self, args: AudioArgs, linears: dict[str, TowerLinear], names: NameTable, lookup):
        super().__init__()
        self.args = args
        self.pre = const(lookup, names.name("lconv1d.pre_layer_norm"))
        self.conv_norm = const(lookup, names.name("lconv1d.conv_norm"))
        self.linear_start = ClippedLinear(linears[names.name("lconv1d.linear_start")])
        self.linear_end = ClippedLinear(linears[names.name("lconv1d.linear_end")])
        self.depthwise = const(lookup, names.name("lconv1d.depthwise_conv1d"))

    def forward(self, x):
        a = self.args
        h = F.glu(self.linear_start(rms_norm(x, self.pre, a.eps)), dim=-1)
        # Causal depthwise convolution (HF Gemma4AudioCausalConv1d: left padding kernel - 1).
        h = F.conv1d(F.pad(h.transpose(1, 2), (a.conv_kernel - 1, 0)), self.depthwise, groups=a.hidden)
        h = F.silu(rms_norm(_clip(h.transpose(1, 2), a), self.conv_norm, a.eps))
        return self.linear_end(h) + x


class _ConformerLayer(nn.Module):
    def __init__(self, args: AudioArgs, linears: dict[str, TowerLinear], index: int, lookup):
        super().__init__()
        p = AUDIO.bind(layer=index)
        self.args = args
        self.feed_forward1 = _FeedForward(args, linears, p, "feed_forward1", lookup)
        self.feed_forward2 = _FeedForward(args, linears, p, "feed_forward2", lookup)
        self.self_attn = _Attention(args, linears, p, lookup)
        self.lconv1d = _LightConv(args, linears, p, lookup)
        self.norms = nn.ParameterDict({key: const(lookup, p.name(key)) for key in AUDIO_LAYER_NORMS})

    def forward(self, x):
        a, n = self.args, self.norms
        x = self.feed_forward1(x)
        h = self.self_attn(rms_norm(_clip(x, a), n["norm_pre_attn"], a.eps))
        x = rms_norm(_clip(h, a), n["norm_post_attn"], a.eps) + x
        x = self.feed_forward2(self.lconv1d(x))
        return rms_norm(_clip(x, a), n["norm_out"], a.eps)


def _clip(x: torch.Tensor, args: AudioArgs) -> torch.Tensor:
    """HF's ``gradient_clipping`` clamp (1e10 by default: kept, it costs nothing)."""
    return torch.clamp(x, -args.gradient_clipping, args.gradient_clipping)


class _Subsample(nn.Module):
    """HF Gemma4AudioSubSampleConvProjection without a mask: [1, T, 128] -> [1, ceil(ceil(T/2)/2), hidden]."""

    def __init__(self, args: AudioArgs, linears: dict[str, TowerLinear], lookup):
        super().__init__()
        self.args = args
        conv0, norm0, conv1, norm1 = AUDIO.names(("subsample.layer0.conv", "subsample.layer0.norm",
                                                  "subsample.layer1.conv", "subsample.layer1.norm"))
        self.conv0, self.norm0 = const(lookup, conv0), const(lookup, norm0)
        self.conv1, self.norm1 = const(lookup, conv1), const(lookup, norm1)
        self.input_proj_linear = ClippedLinear(linears[AUDIO.name("subsample.input_proj_linear")])

    def _block(self, x, conv, norm):
        x = F.conv2d(x, conv, stride=2, padding=1)
        x = F.layer_norm(x.permute(0, 2, 3, 1), (conv.shape[0],), norm, None, self.args.eps)
        return F.relu(x).permute(0, 3, 1, 2)

    def forward(self, features):
        x = self._block(self._block(features.unsqueeze(1), self.conv0, self.norm0), self.conv1, self.norm1)
        x = x.permute(0, 2, 3, 1)  # [1, T', freq, channels]: flattened freq-major as HF does
        return self.input_proj_linear(x.reshape(1, -1, self.args.freq_bins * self.args.channels[1]))


class AudioGraph(nn.Module):
    """input_features [1, T, 128] log-mel -> audio_embeds [1, ceil(ceil(T/2)/2), text_hidden]."""

    def __init__(self, args: AudioArgs, linears: list[TowerLinear], lookup, output_scale: float = 1.0,
                 token_tail: torch.Tensor | None = None, tail_scale: float = 1.0):
        super().__init__()
        by_name = {linear.spec.name: linear for linear in linears}
        self.args = args
        self.out = TokenTail(token_tail, output_scale, tail_scale)
        self.subsample = _Subsample(args, by_name, lookup)
        self.layers = nn.ModuleList(_ConformerLayer(args, by_name, i, lookup) for i in range(args.layers))
        self.output_proj = ClippedLinear(by_name[AUDIO.name("output_proj")])
        self.embedding_projection = ClippedLinear(by_name[AUDIO.name("embedding_projection")])

    def forward(self, input_features):
        x = self.subsample(input_features)
        for layer in self.layers:
            x = layer(x)
        x = self.output_proj(x)
        return self.out(self.embedding_projection(rms_norm(x, None, self.args.eps)))


class Gemma4AudioTower(Gemma4Tower):
    name = "audio"

    def __init__(self, arch, audio_config: dict[str, Any]):
        super().__init__(arch, audio_config, parse_audio_args, audio_linears, AUDIO_TOKENS, "an audio")

    def expected_tensors(self) -> Shapes:
        return {**audio_constants(self.args), **self.linear_tensors(self.args.clipped)}

    def build_graph(self, token_tail: torch.Tensor | None = None) -> nn.Module:
        """With a token tail the runtime's rows are wider than the text hidden size and its
        1/sqrt(hidden_size) (omni.cpp, "usm" audio) no longer cancels the text graph's sqrt(hidden):
        the graph scales its features by ``output_scale`` and its tail by sqrt(hidden_size)."""
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        if token_tail is None:
            return AudioGraph(self.args, self._linears, lookup).eval()
        return AudioGraph(self.args, self._linears, lookup, self.output_scale, token_tail,
                          math.sqrt(self.token_width)).eval()

    @property
    def output_scale(self) -> float:
        """What the exported ``audio.mnn`` multiplies HF's audio features by."""
        return math.sqrt(self.token_width / self.arch.args.hidden_size)

    def graph_inputs(self) -> GraphInputs:
        # 37 frames -> 10 encoder frames: several blocks, the last one partial; T is dynamic.
        return GraphInputs((torch.randn(1, 37, MELS),), ["input_features"], {"input_features": {1: "frames"}},
                           ["audio_embeds"])

    def llm_config(self) -> dict[str, Any]:
        return {"is_audio": True, "audio_model": "audio.mnn", "audio_type": "usm",
                "audio_start": self.ids["boa"], "audio_end": self.ids["eoa"], "audio_pad": self.ids["audio"]}

    # --- verification -----------------------------------------------------------------------
    def verify_lengths(self) -> list[int]:
        """Clip lengths (samples) giving fewer tokens than a chunk, a non-multiple of the chunk,
        and several chunks."""
        c = self.args.chunk
        return [samples_for_tokens(t) for t in (max(1, c - 1), 2 * c + 1, 5 * c + 2)]

    def check(self, prompt_lengths: tuple[int, ...] | None = None) -> TowerCheck:
        """``audio.mnn`` on HF's features of ``verify_lengths`` vs HF's audio features (stored
        weights: max relative error < 1e-3; fp32: reported), and an audio+text prompt per clip length
        (default: the middle verification length) through the runtime (clip given by
        ``save_audio_for_runtime``, so the runtime computes HF's frames) vs HF's full model on the clip."""
        processor = hf_processor(self.checkpoint.path)
        clips = [synthetic_clip(n, seed=n) for n in self.verify_lengths()]
        hf = [processor.feature_extractor([clip], return_tensors="pt") for clip in clips]
        hf = [(f["input_features"], f["input_features_mask"]) for f in hf]
        cases = tuple(FeatureCase(f"clip of {len(clip)} samples", {"input_features": f[:, m[0]].numpy()},
                                  {"samples": len(clip), "frames": int(m.sum())}) for clip, (f, m) in zip(clips, hf))
        prompts = []
        for i, n in enumerate(prompt_lengths or (self.verify_lengths()[1],)):
            inputs, runtime_text = media_prompt(processor, "audio", synthetic_clip(n, seed=i + 1), PROMPT_TAIL)
            frames = {"hf": hf_frame_count(n), "runtime": runtime_frame_count(n + RUNTIME_TAIL),
                      "runtime_unpadded": runtime_frame_count(n)}
            prompts.append(PromptCase(f"{n} samples", f"audio prompt {n} samples (HF framing)", inputs, runtime_text,
                                      {"samples": n, "tokens": inputs["input_ids"][0].tolist().count(self.ids["audio"]),
                                       "frames": frames}, QUESTION))
        return tower_check(
            self.arch, processor, output="audio_embeds", cases=cases, cases_key="clips",
            features=lambda model: [audio_features(model, *f) for f in hf],
            measures={"tokens": Measure.ROWS, "mnn_tokens": Measure.MNN_ROWS, "rel_err": Measure.REL_ERR,
                      "rel_err_fp32": Measure.REL_ERR_FP32},
            feature_bound=FEATURE_BOUND, prompts=tuple(prompts), output_scale=self.output_scale,
            feature_columns=self.feature_columns)


def audio_features(model, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF's audio soft tokens [n, text_hidden] (``Gemma4Model.get_audio_features``, padding stripped)."""
    with torch.no_grad():
        out = model.model.get_audio_features(features, mask, return_dict=True)
    return out.pooler_output[out.attention_mask].float()
