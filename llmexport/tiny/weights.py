"""Random weights for the tiny checkpoints of the decoder families (K2-Horizon, Llama, Qwen3)."""

from __future__ import annotations

import torch

# Matrices N(0, 0.15): large enough that greedy decoding of the tiny models does not settle on
# one repeated token (0.05 does), so decode steps feed the KV cache different tokens.
WEIGHT_STD = 0.15


def randomize(model: torch.nn.Module, generator: torch.Generator, router_bias_range: float = 0.0) -> None:
    """Matrices N(0, WEIGHT_STD); norm gammas uniform in [0.6, 1.4] (a forgotten gamma shows);
    biases N(0, 0.05); router selection biases (``e_score_correction_bias``, LFM2-MoE's
    ``expert_bias``) uniform in [-r, r]."""
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point() or name.endswith("inv_freq"):
                continue
            if tensor.dim() >= 2:
                value = torch.randn(tensor.shape, generator=generator) * WEIGHT_STD
            elif name.endswith(("e_score_correction_bias", "expert_bias")):
                value = (torch.rand(tensor.shape, generator=generator) * 2 - 1) * router_bias_range
            elif name.endswith(".bias"):  # attention_bias
                value = torch.randn(tensor.shape, generator=generator) * 0.05
            else:  # norm gammas
                value = torch.rand(tensor.shape, generator=generator) * 0.8 + 0.6
            tensor.copy_(value.to(tensor.dtype))


def save_random(model_class: str, config, out, seed: int, dtype: torch.dtype) -> None:
    """The transformers class ``model_class`` built from ``config`` (seeded with ``seed``), given
    random weights (``randomize``, seeded with ``seed + 1``) and saved in ``dtype`` to ``out``."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    randomize(model, torch.Generator().manual_seed(seed + 1))
    model.to(dtype).save_pretrained(out, safe_serialization=True)
