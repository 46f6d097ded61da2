"""K2-Horizon causal LM: the PyTorch reference, shipped as remote code beside each checkpoint.

Loaded with ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` through the
``auto_map`` of ``config.json``. It follows what is published of IFM's K2-Horizon (the MLX port
of the official ``modeling_k2_horizon.py``) and the llmexport checkpoint schema: tensor names
are those of the schema, routed experts are stored one linear per expert (``ModuleList``s),
``rotary_emb.inv_freq`` is not saved.

Numerics worth knowing (each mirrors the published description; llmexport docs/k2-horizon.md):
- GroupedRMSNorm normalises each of ``groups`` equal slices in fp32, multiplies by one
  full-width weight in fp32, then casts back.
- Routers compute logits in model precision, scores in fp32; the ``e_score_correction_bias``
  only chooses experts (as in DeepSeek-V3), the weights are the unbiased scores.
- Routed outputs (MoE experts, MoVA value experts after SiLU) are summed in fp32 with routing
  weights first cast to the model dtype, then the sum is cast back.
- Only the chosen experts run: this file is also the semantic reference for the exported graph,
  where MNN's MoE op runs only the chosen expert subgraphs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from .configuration_k2_horizon import K2HorizonConfig

try:  # transformers 5: init helpers that skip tensors already loaded from the checkpoint
    from transformers import initialization as init
except ImportError:  # pragma: no cover - transformers 4.x
    from torch.nn import init  # type: ignore[no-redef]  # the same helpers, without the skip

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
# transformers 5.x renamed the output field ``past_key_values`` to ``cache``.
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} \
    else "past_key_values"


class GroupedRMSNorm(nn.Module):
    """RMSNorm over ``groups`` equal slices of the last dimension, one full-width weight.

    Split the vector into ``groups`` parts, RMS-normalise each part in fp32 (no weight inside),
    reshape back, multiply by the weight in fp32, cast back to the input dtype. ``groups == 1``
    is plain RMSNorm. q/k norms use one group per head.
    """

    def __init__(self, hidden_size: int, groups: int = 1, eps: float = 1e-6):
        super().__init__()
        if hidden_size % groups:
            raise ValueError(f"GroupedRMSNorm: {hidden_size} is not divisible into {groups} groups")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.groups = groups
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float().unflatten(-1, (self.groups, -1))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h.flatten(-2) * self.weight.float()).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, groups={self.groups}, eps={self.eps}"


class K2HorizonRotaryEmbedding(nn.Module):
    """Default (rotate-half) RoPE with ``rope_parameters["rope_theta"]`` over the full head_dim."""

    inv_freq: torch.Tensor

    def __init__(self, config: K2HorizonConfig):
        super().__init__()
        self.register_buffer("inv_freq", self.compute_inv_freq(config), persistent=False)

    @staticmethod
    def compute_inv_freq(config: K2HorizonConfig) -> torch.Tensor:
        base = float(config.rope_parameters["rope_theta"])
        dim = config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float().to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]; cos/sin [b, s, d] (pairs (i, i + d/2), not interleaved)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class K2HorizonMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)); also each routed expert and the shared experts."""

    def __init__(self, config: K2HorizonConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class K2HorizonRouter(nn.Module):
    """Top-k router shared by the MoE block (``mlp.gate``) and MoVA (``self_attn.v_router``).

    A custom module rather than an ``nn.Linear`` so that generic quantizers leave it alone.
    1. logits = x @ W.T in model precision (no bias);  2. scores = sigmoid|softmax in fp32;
    3. choose top-k by scores + e_score_correction_bias (the bias only chooses);
    4. weights = the unbiased scores of the chosen experts;  5. optionally normalise them to
    sum 1, then multiply by the scaling factor. Returns fp32 weights and int64 indices [n, k].
    """

    e_score_correction_bias: torch.Tensor

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring_func: str,
                 norm_topk_prob: bool, scaling_factor: float):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring_func, self.norm_topk_prob = scoring_func, norm_topk_prob
        self.scaling_factor = scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # fp32 by contract (kept out of dtype casts through _keep_in_fp32_modules_strict)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight.to(x.dtype)).float()
        return logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(x)
        chosen = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scaling_factor, chosen


def routed_sum(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: nn.ModuleList,
               out_features: int, activation=None) -> torch.Tensor:
    """sum_k weights[:, k] * activation(experts[chosen[:, k]](x)) for x [n, in].

    Only the chosen experts run, each on the tokens that chose it. The weights are cast to the
    model dtype first and the sum is accumulated in fp32, then cast back (published numerics).
    """
    weights = weights.to(x.dtype)
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for e in chosen.unique().tolist():
        rows, slot = torch.where(chosen == e)
        y = experts[e](x[rows])
        if activation is not None:
            y = activation(y)
        out.index_add_(0, rows, y.float() * weights[rows, slot, None].float())
    return out.to(x.dtype)


class K2HorizonSparseMoeBlock(nn.Module):
    """Routed SwiGLU experts (``experts.E``) plus, with ``num_shared_experts > 0``, one wider
    shared MLP (``shared_experts``) whose output is added without gating."""

    def __init__(self, config: K2HorizonConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.gate = K2HorizonRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                    config.scoring_func, config.norm_topk_prob, config.router_scaling_factor)
        self.experts = nn.ModuleList(K2HorizonMLP(config, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        width = config.num_shared_experts * config.moe_intermediate_size
        self.shared_experts = K2HorizonMLP(config, width) if width > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden_size)
        weights, chosen = self.gate(flat)
        out = routed_sum(flat, weights, chosen, self.experts, self.hidden_size).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class K2HorizonAttention(nn.Module):
    """GQA softmax attention, scale 1/sqrt(head_dim), optional per-head q/k GroupedRMSNorm
    (before RoPE). On MoVA layers the values come from ``v_router`` + ``v_experts`` (bias-free
    linears to ``kv_heads * head_dim``, SiLU before the weighted sum) instead of ``v_proj``."""

    def __init__(self, config: K2HorizonConfig, layer_idx: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.scaling = d ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.mova = config.uses_mova(layer_idx)
        if self.mova:
            self.v_router = K2HorizonRouter(h, config.mova_num_experts, config.mova_top_k, config.scoring_func,
                                            config.mova_norm_topk, config.mova_scaling)
            self.v_experts = nn.ModuleList(nn.Linear(h, self.kv_heads * d, bias=False)
                                           for _ in range(config.mova_num_experts))
        else:
            self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.q_norm: GroupedRMSNorm | None
        self.k_norm: GroupedRMSNorm | None
        if config.query_key_norm:
            self.q_norm = GroupedRMSNorm(self.heads * d, self.heads, config.rms_norm_eps)
            self.k_norm = GroupedRMSNorm(self.kv_heads * d, self.kv_heads, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def mova_values(self, x: torch.Tensor) -> torch.Tensor:
        """Mixture-of-Values: [.., hidden] -> [.., kv_heads * head_dim]."""
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.v_router(flat)
        out = routed_sum(flat, weights, chosen, self.v_experts, self.kv_heads * self.head_dim, F.silu)
        return out.view(*x.shape[:-1], -1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: Cache | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        v = self.mova_values(x) if self.mova else self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary_pos_emb(q.view(b, s, self.heads, -1).transpose(1, 2), cos, sin)
        k = apply_rotary_pos_emb(k.view(b, s, self.kv_heads, -1).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.kv_heads, -1).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling + mask
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class K2HorizonDecoderLayer(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); out = h + mlp(norm(h)). The MLP is the
    sparse MoE block on sparse layers (``config.is_sparse_layer``), SwiGLU otherwise."""

    def __init__(self, config: K2HorizonConfig, layer_idx: int):
        super().__init__()
        groups, eps = config.layernorm_num_groups, config.rms_norm_eps
        self.input_layernorm = GroupedRMSNorm(config.hidden_size, groups, eps)
        self.post_attention_layernorm = GroupedRMSNorm(config.hidden_size, groups, eps)
        self.self_attn = K2HorizonAttention(config, layer_idx)
        self.mlp = (K2HorizonSparseMoeBlock(config) if config.is_sparse_layer(layer_idx)
                    else K2HorizonMLP(config, config.intermediate_size))

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class K2HorizonPreTrainedModel(PreTrainedModel):
    config_class = K2HorizonConfig
    base_model_prefix = "model"
    _no_split_modules = ["K2HorizonDecoderLayer"]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]
    _supports_cache_class = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear, Embedding, and *RMSNorm weights (ones)
        if isinstance(module, K2HorizonRouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, K2HorizonRotaryEmbedding):
            # transformers 5 builds the model on the meta device: a non-persistent buffer is not
            # in the checkpoint and must be recomputed here, or it holds garbage.
            value = module.compute_inv_freq(cast(K2HorizonConfig, self.config))
            if hasattr(init, "copy_"):
                init.copy_(module.inv_freq, value)
            else:  # pragma: no cover - transformers 4.x
                with torch.no_grad():
                    module.inv_freq.copy_(value)


def _additive_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, past: int,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Causal additive mask [b, 1, q_len, past + q_len], with a 2-D padding mask folded in."""
    if attention_mask is not None and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return torch.zeros(attention_mask.shape, dtype=dtype, device=device).masked_fill(
                ~attention_mask, torch.finfo(dtype).min)
        return attention_mask.to(dtype)
    kv_len = past + q_len
    q_pos = torch.arange(past, kv_len, device=device).view(-1, 1)
    allowed = (torch.arange(kv_len, device=device).view(1, -1) <= q_pos).view(1, 1, q_len, kv_len)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -kv_len:].bool().to(device)
    allowed = allowed.expand(batch, 1, q_len, kv_len)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


class K2HorizonModel(K2HorizonPreTrainedModel):
    def __init__(self, config: K2HorizonConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(K2HorizonDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GroupedRMSNorm(config.hidden_size, config.layernorm_num_groups, config.rms_norm_eps)
        self.rotary_emb = K2HorizonRotaryEmbedding(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = cast(nn.Embedding, value)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, past_key_values=None, **kwargs) -> BaseModelOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        b, s = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=x.device).unsqueeze(0).expand(b, s)
        mask = _additive_mask(attention_mask, b, s, past, x.dtype, x.device)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), **{_CACHE_FIELD: cache if use_cache else None})


class K2HorizonForCausalLM(K2HorizonPreTrainedModel, GenerationMixin):
    # transformers 5 maps tied parameters target -> source; 4.x lists the tied names
    _tied_weights_keys: Any = ({"lm_head.weight": "model.embed_tokens.weight"} if _TRANSFORMERS_MAJOR >= 5
                          else ["lm_head.weight"])

    def __init__(self, config: K2HorizonConfig):
        super().__init__(config)
        self.model = K2HorizonModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep: int | torch.Tensor = 0, past_key_values=None,
                **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep, :]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)})


__all__ = ["GroupedRMSNorm", "K2HorizonRouter", "K2HorizonForCausalLM", "K2HorizonModel",
           "K2HorizonPreTrainedModel", "routed_sum"]
