"""K2-Horizon configuration (``model_type`` "k2_horizon"), shipped as remote code.

Checkpoints carry this file beside ``modeling_k2_horizon.py`` and point ``config.json``
``auto_map`` at ``configuration_k2_horizon.K2HorizonConfig``; transformers has no built-in
``k2_horizon``. Defaults describe the dense K2-Horizon-3.7B; ``intermediate_size`` 10240 is not
published and is estimated from the published parameter count (about 5.06B with separate
embedding and lm_head). Config keys follow the llmexport checkpoint schema (Qwen3-MoE /
DeepSeek-V3 style names, see llmexport docs/k2-horizon.md).

Written in the classic ``__init__`` style rather than the dataclass style of transformers 5
built-ins, so that the same file loads under transformers 4.x and 5.x as remote code.
"""

from __future__ import annotations

from typing import Any

try:  # transformers 5 spells it PreTrainedConfig; 4.x only has PretrainedConfig
    from transformers.configuration_utils import PreTrainedConfig as _BaseConfig
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers.configuration_utils import PretrainedConfig as _BaseConfig

SCORING_FUNCS = ("sigmoid", "softmax")


class K2HorizonConfig(_BaseConfig):
    model_type = "k2_horizon"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 250624,
        hidden_size: int = 2560,
        intermediate_size: int = 10240,
        num_hidden_layers: int = 36,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = 128,
        hidden_act: str = "silu",
        max_position_embeddings: int = 524288,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        layernorm_num_groups: int = 2,
        query_key_norm: bool = False,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        rope_parameters: dict[str, Any] | None = None,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        # sparse members (unused by the dense 3.7B, whose mlp_only_layers lists every layer and
        # num_experts is 0)
        mlp_only_layers: list[int] | None = None,
        decoder_sparse_step: int = 1,
        num_experts: int = 0,
        num_experts_per_tok: int = 0,
        moe_intermediate_size: int = 0,
        num_shared_experts: int = 0,
        scoring_func: str = "sigmoid",
        norm_topk_prob: bool = True,
        router_scaling_factor: float = 1.0,
        mova_num_experts: int = 0,
        mova_top_k: int = 0,
        mova_norm_topk_prob: bool | None = None,
        mova_router_scaling_factor: float | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        **kwargs: Any,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.layernorm_num_groups = layernorm_num_groups
        self.query_key_norm = query_key_norm
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        # K2-Horizon-3.7B: rotate-half RoPE, base 1e7
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10_000_000.0})
        self.use_cache = use_cache
        self.mlp_only_layers = [] if mlp_only_layers is None else list(mlp_only_layers)
        self.decoder_sparse_step = decoder_sparse_step
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.router_scaling_factor = router_scaling_factor
        self.mova_num_experts = mova_num_experts
        self.mova_top_k = mova_top_k
        # null = use the MoE router's value (schema rule)
        self.mova_norm_topk_prob = mova_norm_topk_prob
        self.mova_router_scaling_factor = mova_router_scaling_factor
        self._validate()
        # transformers 4 reads these in PretrainedConfig.__init__; 5 takes them as keyword fields
        # its declared signature does not list
        common: dict[str, Any] = dict(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                                      tie_word_embeddings=tie_word_embeddings)
        super().__init__(**common, **kwargs)

    def _validate(self) -> None:
        if self.hidden_size % self.layernorm_num_groups:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by layernorm_num_groups "
                             f"{self.layernorm_num_groups}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} not in {SCORING_FUNCS}")
        if self.rope_parameters.get("rope_type", "default") != "default":
            raise ValueError("K2-Horizon uses rope_type 'default' (rotate-half) only")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in 1..num_experts")
        if self.mova_num_experts and not 0 < self.mova_top_k <= self.mova_num_experts:
            raise ValueError("mova_top_k must be in 1..mova_num_experts")

    # MoVA router settings, resolved (null = the MoE router's value)
    @property
    def mova_norm_topk(self) -> bool:
        return self.norm_topk_prob if self.mova_norm_topk_prob is None else bool(self.mova_norm_topk_prob)

    @property
    def mova_scaling(self) -> float:
        return self.router_scaling_factor if self.mova_router_scaling_factor is None \
            else float(self.mova_router_scaling_factor)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """The sparse-layer rule (as Qwen2/3-MoE): not in ``mlp_only_layers``, experts exist,
        and ``(layer_idx + 1)`` is a multiple of ``decoder_sparse_step``."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def uses_mova(self, layer_idx: int) -> bool:
        """A sparse layer takes its values from MoVA only when value experts exist; otherwise it
        keeps ``v_proj``."""
        return self.is_sparse_layer(layer_idx) and self.mova_num_experts > 0


__all__ = ["K2HorizonConfig"]
