"""What Gemma4's vision and audio towers share: clipped placeholder linears and the checkpoint
tensors behind them (the towers' names: names.py; what verification checks of them:
tower_checks.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from llmexport.errors import InputError
from llmexport.models.base import Tower
from llmexport.models.graph_parts import TensorLookup, const  # noqa: F401 (the towers' graphs import them here)
from llmexport.models.tensor_checks import Shapes, check_finite, count_limit
from llmexport.models.tensor_names import bias_name, weight_name
from llmexport.source.checkpoint import SafetensorsIndex
from llmexport.spec import LinearRole, LinearSource, LinearSpec
from llmexport.trace.ops import PlaceholderLinear


@dataclass(frozen=True)
class TowerLinear:
    """One placeholder linear of a tower and the checkpoint tensors behind it."""

    spec: LinearSpec
    weight: str
    bias: str | None = None
    clip: tuple[float | None, float | None, float | None, float | None] | None = None  # in min/max, out min/max
    clippable: bool = False  # HF's Gemma4ClippableLinear (its clip scalars are checkpoint tensors)


def mllm_runtime_config() -> dict[str, Any]:
    """config.json ``mllm`` block: the towers' own runtime, read when the model is created
    (llmconfig.hpp). Its defaults are fp16 activations and memory "low" (the cheaper dequant path
    with visibly larger error); the towers run in fp32 with memory "normal"."""
    return {"mllm": {"backend_type": "cpu", "thread_num": 4, "precision": "normal", "memory": "normal"}}


def tower_linear(weights: SafetensorsIndex, base: str, in_features: int, out_features: int, role: LinearRole,
                 clippable: bool, clipped: bool = False, bias: bool = False) -> TowerLinear:
    """HF ``Gemma4ClippableLinear`` (``{base}.linear.weight``) or a plain ``nn.Linear`` (``{base}.weight``).

    With ``clipped`` (the config's ``use_clipped_linears``) the bounds are the checkpoint's
    ``input_min/input_max/output_min/output_max`` scalars; infinite ones (HF's init) are dropped
    so the graph carries no no-op clamps.
    """
    clip = None
    if clippable and clipped:
        where = weights.folder if weights.folder is not None else "checkpoint"
        values: list[float | None] = []
        for name in clip_buffer_names(base):
            value = float(check_finite(name, weights.tensor(name).float(), where, allow_inf=True)) \
                if name in weights else math.inf
            values.append(value if math.isfinite(value) else None)
        in_min, in_max, out_min, out_max = values
        clip = (in_min, in_max, out_min, out_max) if any(v is not None for v in values) else None
    weight = weight_name(base + ".linear") if clippable else weight_name(base)  # the clippable's inner nn.Linear
    spec = LinearSpec(base, in_features, out_features, role, bias)
    return TowerLinear(spec, weight, bias_name(base) if bias else None, clip, clippable)


def token_ids(config: dict[str, Any], keys: dict[str, tuple[str, ...]], what: str) -> dict[str, int]:
    """name -> the id under the first of its config ``keys`` that is set (transformers spells some
    two ways); ``what`` names the checkpoint in the error when one is missing."""
    ids = {}
    for name, spellings in keys.items():
        value = next((config[key] for key in spellings if config.get(key) is not None), None)
        if value is None:
            first = [spellings[0] for spellings in keys.values()]
            raise InputError(f"{what} needs {', '.join(first[:-1])} and {first[-1]}")
        ids[name] = int(value)
    return ids


def clip_buffer_names(base: str) -> list[str]:
    """A ``Gemma4ClippableLinear``'s clip bounds (input min/max, output min/max)."""
    return [f"{base}.{key}" for key in ("input_min", "input_max", "output_min", "output_max")]


class Gemma4Tower(Tower):
    """What both Gemma4 towers hold: the architecture and its checkpoint, the tower's parsed config
    (``args``), the token ids its runtime keys name (``ids``) and its linears (``TowerLinear``)."""

    def __init__(self, arch, tower_config: dict[str, Any], parse: Callable[..., Any],
                 linears: Callable[[Any, SafetensorsIndex], list[TowerLinear]], token_keys: dict[str, tuple[str, ...]],
                 what: str):
        self.arch = arch
        self.checkpoint = arch.checkpoint
        where = str(self.checkpoint.path / "config.json")
        self.args = parse(tower_config, arch.args.hidden_size, where, count_limit(self.checkpoint.weights))
        self.ids = token_ids(self.checkpoint.config, token_keys, f"{where}: {what} checkpoint")
        self._linears: list[TowerLinear] = linears(self.args, self.checkpoint.weights)

    def runtime_config(self) -> dict[str, Any]:
        return mllm_runtime_config()

    @property
    def token_width(self) -> int:
        """The width of the runtime's token input rows (llm_config.json ``hidden_size``)."""
        a = self.arch.args
        return a.hidden_size + a.num_layers * a.ple_dim

    @property
    def feature_columns(self) -> int | None:
        """Columns of a soft token that are HF's features; None: all (no PLE tail)."""
        a = self.arch.args
        return a.hidden_size if a.ple_dim else None

    def linears(self) -> list[LinearSpec]:
        return [linear.spec for linear in self._linears]

    def _linear(self, name: str) -> TowerLinear:
        linear = next((linear for linear in self._linears if linear.spec.name == name), None)
        if linear is None:
            raise KeyError(f"the {self.name} tower has no placeholder linear {name!r}")
        return linear

    def linear_source(self, name: str) -> LinearSource:
        linear = self._linear(name)
        return LinearSource(linear.weight, None, linear.bias)

    def linear_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        linear = self._linear(name)
        weights = self.checkpoint.weights
        return weights.lazy(linear.weight).read(), (weights.lazy(linear.bias).read() if linear.bias else None)

    def linear_tensors(self, clipped: bool) -> Shapes:
        """Checkpoint tensors behind the linears (name -> shape; None: clip scalars)."""
        expected: Shapes = {}
        for linear in self._linears:
            s = linear.spec
            expected[linear.weight] = (s.out_features, s.in_features)
            if linear.bias:
                expected[linear.bias] = (s.out_features,)
            if clipped and linear.clippable:
                expected.update({name: None for name in clip_buffer_names(s.name)})
        return expected


class TextRowTower(Gemma4Tower):
    """A tower whose soft tokens are text embedding rows with nothing after them (no per-layer
    embedding tail): Gemma3's and Qwen3.5's vision towers."""

    @property
    def token_width(self) -> int:
        return self.arch.args.hidden_size

    @property
    def feature_columns(self) -> int | None:
        return None


class TokenTail(nn.Module):
    """Appends the runtime token input's tail (mnn/token_table.py) to every soft token:
    ``[features * feature_scale | tail * tail_scale]``; the scales undo what the runtime and the
    text graph do to the row (the runtime's own scaling of tower outputs, the media mark)."""

    def __init__(self, tail: torch.Tensor | None, feature_scale: float, tail_scale: float):
        super().__init__()
        self.feature_scale = feature_scale
        self.tail = None if tail is None else nn.Parameter((tail.float() * tail_scale).view(1, 1, -1),
                                                           requires_grad=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        out = features * self.feature_scale if self.feature_scale != 1.0 else features
        if self.tail is None:
            return out
        # zeros [1, rows, 1] + tail [1, 1, width]: the rows are dynamic, the width is not
        return torch.cat([out, torch.zeros_like(out[..., :1]) + self.tail], dim=-1)


class ClippedLinear(nn.Module):
    """HF ``Gemma4ClippableLinear``: clamp the input, linear, clamp the output."""

    def __init__(self, linear: TowerLinear):
        super().__init__()
        s = linear.spec
        self.linear = PlaceholderLinear(s.name, s.in_features, s.out_features, s.bias)
        self.clip = linear.clip or (None, None, None, None)

    def forward(self, x):
        in_min, in_max, out_min, out_max = self.clip
        if in_min is not None or in_max is not None:
            x = torch.clamp(x, in_min, in_max)
        x = self.linear(x)
        if out_min is not None or out_max is not None:
            x = torch.clamp(x, out_min, out_max)
        return x


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Plain softmax attention without a KV cache (towers are bidirectional encoders).

    q [1, N, heads, D], k/v [1, N, kv_heads, D], additive mask broadcastable to [1, 1, N, N];
    returns [1, N, heads * D]. KV heads are repeated with expand + reshape (HF ``repeat_kv``);
    ``repeat_interleave`` would trace into OneHot/Tile chains.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if heads != kv_heads:
        groups = heads // kv_heads
        k = k.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(k.shape[0], heads, k.shape[2], k.shape[3])
        v = v.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(v.shape[0], heads, v.shape[2], v.shape[3])
    scores = torch.matmul(q, k.transpose(2, 3))
    if scale != 1.0:
        scores = scores * scale
    probs = torch.softmax(scores + mask, dim=-1)
    out = torch.matmul(probs, v).transpose(1, 2)
    return out.reshape(out.shape[0], out.shape[1], -1)
