"""A top-k router whose bias only chooses: K2-Horizon's ``K2HorizonRouter`` and LFM2-MoE's
``Lfm2MoeTopKRouter`` (transformers models/lfm2_moe/modeling_lfm2_moe.py).

Scores (sigmoid or softmax of the router logits, in fp32) plus a per-expert bias pick the top-k
experts; the chosen experts are weighed by their unbiased scores, optionally renormalised to sum
1 (LFM2-MoE adds 1e-6 to that sum, K2-Horizon nothing), then scaled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmexport.trace.ops import PlaceholderLinear


@dataclass(frozen=True)
class RouterSpec:
    """A top-k router: scores (sigmoid|softmax, fp32) choose by score + bias, weigh unbiased,
    optionally normalised to sum 1, then scaled."""

    num_experts: int
    top_k: int
    scoring: str
    normalize: bool
    scale: float


class Router(nn.Module):
    """The router on [1, seq, hidden] -> (fp32 weights, chosen) [1, seq, k].

    Routers see the 3-D hidden states: placeholder linears come back 3-D in MNN whatever the
    traced rank, so every op after them keeps the rank it was traced with. The unbiased scores
    of the chosen experts are picked with a one-hot product rather than a gather: exact (one
    non-zero term per sum) and plain Equal/Mul/ReduceSum for MNN. ``normalize_eps``: added to the
    sum the weights are renormalised by (LFM2-MoE: 1e-6; 0 adds nothing to the graph).
    """

    bias: torch.Tensor
    expert_ids: torch.Tensor

    def __init__(self, name: str, hidden: int, spec: RouterSpec, bias: torch.Tensor, normalize_eps: float = 0.0):
        super().__init__()
        self.spec, self.normalize_eps = spec, normalize_eps
        self.proj = PlaceholderLinear(name, hidden, spec.num_experts)
        self.register_buffer("bias", bias.float().clone(), persistent=False)
        self.register_buffer("expert_ids", torch.arange(spec.num_experts), persistent=False)

    def forward(self, x):
        logits = self.proj(x).float()
        scores = torch.sigmoid(logits) if self.spec.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(scores + self.bias, self.spec.top_k, dim=-1)
        one_hot = (chosen.unsqueeze(-1) == self.expert_ids).to(scores.dtype)
        weights = (one_hot * scores.unsqueeze(-2)).sum(dim=-1)
        if self.spec.normalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + self.normalize_eps if self.normalize_eps else total)
        return weights * self.spec.scale, chosen
