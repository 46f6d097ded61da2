"""The tensor names of HF's Llama layout (``LlamaForCausalLM`` and the decoders built like it),
and the helpers that list a layer's linears and norms by them.

Llama, Qwen3 and Qwen3-MoE share this table (their differences are data in their family files);
K2-Horizon extends it with its MoVA and MoE tensors (k2_horizon.py). Linears are named by their
module path (tensors ``{path}.weight``, ``{path}.bias``), norms by their gamma
(llmexport/models/tensor_names.py).
"""

from __future__ import annotations

from typing import AbstractSet, Any, Callable, Union

from llmexport.models.tensor_checks import Shapes
from llmexport.models.tensor_names import LinearList, NameTable, match, weight_name
from llmexport.spec import LinearRole, NormFormula, ScaleGroup

#: a gated MLP's linears (gate, up, down) on dense layers, in a routed expert, in shared experts
MLP = ("mlp.gate", "mlp.up", "mlp.down")
EXPERT_MLP = ("moe.expert.gate", "moe.expert.up", "moe.expert.down")
#: a routed expert of a checkpoint that stores its experts stacked: one fused gate_up linear (a
#: row of gate_up_proj, gate rows first) and down
STACKED_EXPERT = ("moe.expert.gate_up", "moe.expert.down")
#: the pre-norm layer's RMSNorms, and the per-head q/k norms where the family has them
LAYER_NORMS = ("norm.input", "norm.post_attention")
QK_NORMS = ("norm.q", "norm.k")

LLAMA_LAYOUT = NameTable({
    "embed": "model.embed_tokens.weight",
    "norm.final": "model.norm.weight",
    "lm_head": "lm_head",
    "attn.q": "model.layers.{layer}.self_attn.q_proj",
    "attn.k": "model.layers.{layer}.self_attn.k_proj",
    "attn.v": "model.layers.{layer}.self_attn.v_proj",
    "attn.o": "model.layers.{layer}.self_attn.o_proj",
    "norm.q": "model.layers.{layer}.self_attn.q_norm.weight",
    "norm.k": "model.layers.{layer}.self_attn.k_norm.weight",
    "norm.input": "model.layers.{layer}.input_layernorm.weight",
    "norm.post_attention": "model.layers.{layer}.post_attention_layernorm.weight",
    "mlp.gate": "model.layers.{layer}.mlp.gate_proj",
    "mlp.up": "model.layers.{layer}.mlp.up_proj",
    "mlp.down": "model.layers.{layer}.mlp.down_proj",
    # sparse layers: a router and routed experts (one module per expert, as the hub saves them)
    "moe.router": "model.layers.{layer}.mlp.gate",
    "moe.expert": "model.layers.{layer}.mlp.experts.{expert}",
    "moe.expert.gate": "model.layers.{layer}.mlp.experts.{expert}.gate_proj",
    "moe.expert.up": "model.layers.{layer}.mlp.experts.{expert}.up_proj",
    "moe.expert.down": "model.layers.{layer}.mlp.experts.{expert}.down_proj",
})


#: an expert's linear -> the key of transformers' stacked tensor that holds it and which block of
#: ``width`` rows it fills (None: all of the expert's slice); gate before up, as Qwen3MoeExperts and
#: Lfm2MoeExperts keep them
REFERENCE_EXPERT_SLOTS = {"moe.expert.gate": ("reference.experts.gate_up", 0),
                          "moe.expert.up": ("reference.experts.gate_up", 1),
                          "moe.expert.down": ("reference.experts.down", None)}


def stacked_expert_slot(names: NameTable, tensor: str, width: int) -> tuple[str, tuple[Any, ...]] | None:
    """Where a per-expert checkpoint ``tensor`` lies in the reference's stacked experts
    (``gate_up_proj`` [E, 2 * width, hidden], ``down_proj`` [E, hidden, width]; ``names`` has the
    keys of ``REFERENCE_EXPERT_SLOTS``); None for any other tensor."""
    for key, (stacked, block) in REFERENCE_EXPERT_SLOTS.items():
        fields = match(weight_name(names.pattern(key)), tensor)
        if fields is None:
            continue
        name = names.name(stacked, layer=fields["layer"])
        if block is None:
            return name, (fields["expert"],)
        return name, (fields["expert"], slice(block * width, (block + 1) * width))
    return None


#: which attention projections carry a bias: all or none, or the set of their keys (Qwen2: q, k, v)
Biases = Union[bool, AbstractSet[str]]


def has_bias(bias: Biases, key: str) -> bool:
    return bias if isinstance(bias, bool) else key in bias


def add_attention(linears: LinearList, layer: int, hidden: int, q_width: int, kv_width: int, bias: Biases,
                  values: Callable[[], None] | None = None) -> None:
    """``attn.q``, ``attn.k``, the value projection(s) (``attn.v``, or what ``values`` adds), ``attn.o``."""
    linears.add("attn.q", hidden, q_width, LinearRole.ATTENTION, has_bias(bias, "attn.q"), layer=layer)
    linears.add("attn.k", hidden, kv_width, LinearRole.ATTENTION, has_bias(bias, "attn.k"), layer=layer)
    if values is None:
        linears.add("attn.v", hidden, kv_width, LinearRole.ATTENTION, has_bias(bias, "attn.v"), layer=layer)
    else:
        values()
    linears.add("attn.o", q_width, hidden, LinearRole.ATTENTION, has_bias(bias, "attn.o"), layer=layer)


def add_mlp(linears: LinearList, keys: tuple[str, str, str], hidden: int, width: int, role: LinearRole,
            **fields: int) -> None:
    """A gated MLP's gate, up and down projections (``keys`` in that order)."""
    linears.add_group(keys, ((hidden, width), (hidden, width), (width, hidden)), role, **fields)


def expert_linears(stacked: bool) -> tuple[str, ...]:
    """A routed expert's linear keys: gate_up and down where the checkpoint stores the experts
    stacked (``STACKED_EXPERT``), else gate, up and down (``EXPERT_MLP``)."""
    return STACKED_EXPERT if stacked else EXPERT_MLP


def add_routed(linears: LinearList, layer: int, hidden: int, num_experts: int, width: int,
               stacked: bool = False) -> None:
    """A router ``moe.router`` and its experts' gated MLPs (``expert_linears(stacked)``)."""
    linears.add("moe.router", hidden, num_experts, LinearRole.ROUTER, layer=layer)
    for e in range(num_experts):
        if stacked:
            linears.add_group(STACKED_EXPERT, ((hidden, 2 * width), (width, hidden)), LinearRole.EXPERT,
                              layer=layer, expert=e)
        else:
            add_mlp(linears, EXPERT_MLP, hidden, width, LinearRole.EXPERT, layer=layer, expert=e)


def pre_norm_shapes(names: NameTable, layer: int, hidden: int, qk_widths: tuple[int, int] | None) -> Shapes:
    """One pre-norm layer's RMSNorm gammas: input and post-attention norms, and the q/k norms
    (``qk_widths``: their widths, None without them)."""
    shapes: Shapes = {name: (hidden,) for name in names.names(LAYER_NORMS, layer=layer)}
    if qk_widths is not None:
        shapes.update({name: (width,) for name, width in zip(names.names(QK_NORMS, layer=layer), qk_widths)})
    return shapes


#: why a scale group is left alone (the reasons the families give)
ROUTED_EXPERTS = "routed experts read this norm (their stacked weights share one input scale)"


def layer_scale_groups(names: NameTable, layer: int, norms: tuple[str, str], attention: tuple[str, ...],
                       heads_per_kv: int, head_dim: int, formula: NormFormula = NormFormula.SCALE,
                       value_skip: str | None = None, mlp_skip: str | None = None) -> list[ScaleGroup]:
    """A pre-norm layer's scale groups: the attention norm before ``attention`` (keys: q, then k
    and v where the layer has them), the MLP norm before gate and up, v before o, up before down.
    ``norms``: the keys of the attention norm and of the MLP norm; ``value_skip``/``mlp_skip``:
    why v -> o or the MLP groups would not be exact (None: they are)."""
    p = names.bind(layer=layer)
    groups = [ScaleGroup(layer, tuple(p.names(attention)), norm=p.name(norms[0]), formula=formula)]
    if mlp_skip is None:
        groups += [ScaleGroup(layer, tuple(p.names(MLP[:2])), norm=p.name(norms[1]), formula=formula),
                   ScaleGroup(layer, (p.name(MLP[2]),), producer=p.name(MLP[1]))]
    else:
        groups.append(ScaleGroup(layer, (), norm=p.name(norms[1]), formula=formula, skip=mlp_skip))
    if "attn.v" in attention:
        groups.append(ScaleGroup(layer, (p.name("attn.o"),), producer=p.name("attn.v"), heads_per_kv=heads_per_kv,
                                 head_dim=head_dim, skip=value_skip))
    return groups
