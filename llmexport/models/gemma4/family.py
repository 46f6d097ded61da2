"""Gemma4 family (``gemma4`` multimodal checkpoints, ``gemma4_text`` text-only checkpoints).

Text decoder export: E2B/E4B (per-layer embeddings, KV sharing), 31B (K=V, per-type KV
heads), 26B-A4B (dense MLP in parallel with a routed MoE). Vision and audio towers are exported
as their own graphs (vision.py, audio.py).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn

from llmexport.errors import InputError
from llmexport.mnn.config import Precision
from llmexport.models.base import Tower
from llmexport.models.decoder.family import DecoderFamily, expert_template
from llmexport.models.decoder.names import add_mlp, layer_scale_groups
from llmexport.models.gemma4.args import SLIDING, Gemma4TextArgs, parse_text_args
from llmexport.models.gemma4.graph import Expert, Gemma4TextGraph
from llmexport.models.gemma4.names import (
    EXPERT,
    LAYER_NORMS,
    MLP,
    MLX_EXPERTS,
    MLX_TEXT,
    MLX_TEXT_PREFIX,
    MOE_NORMS,
    TEXT,
    TEXT_PREFIX,
)
from llmexport.models.layer_types import mix_config, mixed_graph_inputs
from llmexport.models.tensor_checks import Shapes, count_limit, finite_lookup, require_stacked
from llmexport.models.tensor_names import LinearList, prefix_rule, rename_rule
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import ArchitectureSummary, ExpertTemplate, GraphInputs, LazyRows, LinearRole, MlxLayout, ScaleGroup

log = logging.getLogger(__name__)

# The checkpoint's chat template in the form MNN's runtime renders like transformers (the
# built-in MINJA_CHAT_TEMPLATE only when the checkpoint has none): chat_template.py.
from llmexport.models.gemma4.chat_template import MINJA_CHAT_TEMPLATE, gemma4_jinja  # noqa: E402,F401

# Gemma4's turn end, and Gemma 1-3's, which some tokenizers keep.
END_OF_TURN_TOKENS = ("<turn|>", "<end_of_turn>")


def _kind(model_type: str | None) -> str:
    """"gemma4" (multimodal: the text decoder inside the language model) or "gemma4_text"."""
    return "gemma4" if model_type == "gemma4" else "gemma4_text"


class Gemma4(DecoderFamily):
    #: fp32 activations: real Gemma checkpoints overflow fp16 (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.NORMAL
    family = "Gemma4"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        where = str(checkpoint.path / "config.json")
        config = checkpoint.config
        kind = _kind(checkpoint.model_type)
        if kind == "gemma4":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise InputError(f"{where}: a 'gemma4' config needs a 'text_config' object")
            text = dict(text)
            text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
        else:
            text = config
        prefix = TEXT_PREFIX[kind]
        self.names = TEXT.bind(prefix=prefix)
        weights = checkpoint.weights
        self.args: Gemma4TextArgs = parse_text_args(text, prefix, where, max_layers=count_limit(weights))
        if self.args.moe:  # sized by the stacked expert tensor, not by the config alone
            for layer in self.args.layers:
                require_stacked(weights, self.names.name("moe.experts.down", layer=layer.index),
                                self.args.moe.num_experts, "num_experts", checkpoint.path)
        self._linears = self._collect_linears()
        self._towers = self._build_towers()
        self.check_weights()

    # --- weights ----------------------------------------------------------------------------
    def _collect_linears(self) -> LinearList:
        a = self.args
        linears = LinearList(self.names)
        if a.ple_dim:
            linears.add("ple.model_projection", a.hidden_size, a.num_layers * a.ple_dim, LinearRole.PLE)
        for layer in a.layers:
            i, h, d = layer.index, a.hidden_size, layer.head_dim
            linears.add("attn.q", h, a.num_heads * d, LinearRole.ATTENTION, layer=i)
            if not layer.shares_kv:
                linears.add("attn.k", h, layer.kv_heads * d, LinearRole.ATTENTION, layer=i)
                if not layer.k_eq_v:
                    linears.add("attn.v", h, layer.kv_heads * d, LinearRole.ATTENTION, layer=i)
            linears.add("attn.o", a.num_heads * d, h, LinearRole.ATTENTION, layer=i)
            add_mlp(linears, MLP, h, layer.mlp_width, LinearRole.MLP, layer=i)
            if a.moe:
                linears.add("moe.router", h, a.moe.num_experts, LinearRole.ROUTER, layer=i)
                for e in range(a.moe.num_experts):
                    linears.add_group(EXPERT, ((h, 2 * a.moe.width), (a.moe.width, h)), LinearRole.EXPERT,
                                      layer=i, expert=e)
            if a.ple_dim:
                linears.add_group(("ple.gate", "ple.projection"), ((h, a.ple_dim), (a.ple_dim, h)), LinearRole.PLE,
                                  layer=i)
        self.add_head(linears)
        return linears

    def scale_groups(self) -> list[ScaleGroup]:
        """q (k and v where the layer computes its own) after the input norm, the dense MLP after
        the pre-feedforward norm (the routed experts read their own norm), up before down. v
        before o is declared but left alone: values are RMS-normalised per head (v_norm), which a
        per-channel scale of v does not pass through."""
        a, groups = self.args, []
        for layer in a.layers:
            attention = ("attn.q",) if layer.shares_kv else ("attn.q", "attn.k") if layer.k_eq_v else \
                ("attn.q", "attn.k", "attn.v")
            groups += layer_scale_groups(self.names, layer.index, ("norm.input", "norm.pre_feedforward"), attention,
                                         a.num_heads // layer.kv_heads, layer.head_dim,
                                         value_skip="values are RMS-normalised per head (v_norm) before attention")
        return groups

    def constant_shapes(self) -> Shapes:
        a, names = self.args, self.names
        shapes: Shapes = {names.name("norm.final"): None}
        if a.ple_dim:
            shapes[names.name("norm.ple_projection")] = None
        for layer in a.layers:
            keys = list(LAYER_NORMS) + ([] if layer.shares_kv else ["norm.k"])
            keys += ["norm.post_ple"] if a.ple_dim else []
            keys += list(MOE_NORMS) if a.moe else []
            shapes.update({name: None for name in names.names(keys, layer=layer.index)})
            shapes[names.name("layer_scalar", layer=layer.index)] = (1,)
            if a.moe:
                shapes.update({name: None for name in names.names(("moe.router_scale", "moe.per_expert_scale"),
                                                                  layer=layer.index)})
        return shapes

    def table_shapes(self) -> Shapes:
        a = self.args
        tables: Shapes = {self.embedding_name: (a.vocab_size, a.hidden_size)}
        if a.ple_dim:
            tables[self.names.name("ple.table")] = (a.ple_vocab, a.num_layers * a.ple_dim)
        return tables

    def stacked_count(self, tensor: str) -> int:
        if self.args.moe is None:
            raise NotImplementedError("a dense Gemma4 stacks no experts")
        return self.args.moe.num_experts

    def _build_towers(self) -> list:
        """Vision/audio towers named by a multimodal config, each exported as its own graph."""
        config = self.checkpoint.config
        towers: list[Tower] = []
        if self.checkpoint.model_type == "gemma4" and config.get("vision_config"):
            from llmexport.models.gemma4.vision import Gemma4VisionTower

            towers.append(Gemma4VisionTower(self, config["vision_config"]))
        if self.checkpoint.model_type == "gemma4" and config.get("audio_config"):
            from llmexport.models.gemma4.audio import Gemma4AudioTower

            towers.append(Gemma4AudioTower(self, config["audio_config"]))
        return towers

    def media_token_ids(self) -> tuple[int, ...]:
        """Token ids whose positions carry soft tokens (image, audio, video)."""
        config = self.checkpoint.config
        keys = ("image_token_id", "audio_token_id", "video_token_id")
        return tuple(int(config[k]) for k in keys if config.get(k) is not None)

    def ple_lookup_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Multimodal PLE rule: at media-token positions the per-layer-embedding lookup uses the
        pad id, never the media token's own row (HF ``Gemma4Model.forward``, ``llm_input_ids``;
        MNN 3.6.1 does the same with id 0 in ``Omni::embedding``). The PLE projection input there
        is the merged embedding, i.e. the soft token (HF passes the merged ``inputs_embeds`` to
        ``project_per_layer_inputs``; its pad-embedding copy only reaches ``get_per_layer_inputs``,
        which ignores it when ids are given), and so is the runtime's. The exported towers append
        the pad id's stored PLE row to each soft token (mnn/token_table.py)."""
        media = torch.tensor(self.media_token_ids(), dtype=ids.dtype)
        return torch.where(torch.isin(ids, media), torch.full_like(ids, self.args.pad_token_id), ids)

    def media_ple_id(self) -> int:
        return self.args.pad_token_id

    def ple_table(self) -> LazyRows | None:
        if not self.args.ple_dim:
            return None
        return self.checkpoint.weights.lazy(self.names.name("ple.table"))

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self) -> nn.Module:
        return Gemma4TextGraph(self.args, self.names, finite_lookup(self.checkpoint.weights, self.checkpoint.path),
                               self.marks_images).eval()

    @property
    def marks_images(self) -> bool:
        """Image spans attend both ways on sliding layers: visual.mnn marks its soft tokens for
        the text graph (media.py)."""
        return (self.args.bidirectional_vision and len(self.args.rope) > 1
                and any(tower.name == "visual" for tower in self._towers))

    def graph_inputs(self, seq_len: int) -> GraphInputs:
        a = self.args
        return mixed_graph_inputs(seq_len, a.hidden_size + a.num_layers * a.ple_dim, len(a.rope) > 1)

    def expert_templates(self) -> list[ExpertTemplate]:
        a = self.args
        if a.moe is None:
            return []
        width, experts = a.moe.width, range(a.moe.num_experts)
        return [expert_template(self.names, "moe.expert", EXPERT, lambda names: Expert(names, a.hidden_size, width),
                                a.hidden_size, ((layer.index, layer.index, e) for layer in a.layers for e in experts))]

    def describe(self) -> ArchitectureSummary:
        a = self.args
        layers = []
        for layer in a.layers:
            kind = "sliding" if layer.kind == SLIDING else "full"
            extra = [f"kv<-{layer.kv_source}" if layer.shares_kv else f"kv_heads={layer.kv_heads}",
                     f"head_dim={layer.head_dim}"] + (["k=v"] if layer.k_eq_v else [])
            layers.append(f"{layer.index}: {kind} " + " ".join(extra))
        return ArchitectureSummary("gemma4", self.checkpoint.model_type, a.num_layers, a.hidden_size, a.vocab_size,
                                   a.tie_embeddings, tuple(layers),
                                   {"ple_dim": a.ple_dim, "moe": None if a.moe is None else vars(a.moe)})

    # --- runtime files ----------------------------------------------------------------------
    def llm_config(self) -> dict[str, Any]:
        a = self.args
        mix = mix_config(a.rope, a.sliding_window)
        config: dict[str, Any] = {
            "model_type": "gemma4",
            "hidden_size": a.hidden_size,
            "layer_nums": a.num_layers,
            "attention_type": mix.pop("attention_type"),
            "attn_scale": 1.0,
            "max_position_embeddings": a.max_position_embeddings,
            "jinja": gemma4_jinja(self.checkpoint_chat_template()),
        }
        return config | mix


    def end_of_turn_tokens(self) -> tuple[str, ...]:
        return END_OF_TURN_TOKENS

    # --- reference --------------------------------------------------------------------------
    def reference_loader(self):
        import transformers

        return (transformers.Gemma4ForConditionalGeneration if self.checkpoint.model_type == "gemma4"
                else transformers.Gemma4ForCausalLM)

    def reference_logits(self, model: nn.Module, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Logits of HF's text decoder + lm_head + softcapping for a text prompt.

        The decoder is called directly, not through ``Gemma4ForConditionalGeneration``: that
        wrapper turns media-token ids into pad ids (meant for prompts carrying media), whereas
        a media token in plain text reaches the runtime's text graph as itself.
        """
        ids = ids.view(1, -1)
        inner = cast(nn.Module, model.model)
        decoder = cast(nn.Module, getattr(inner, "language_model", inner))
        head = cast(nn.Module, model.lm_head)
        # A tensor logits_to_keep (all positions) also keeps HF from its KV-shared-layer
        # slicing shortcut, which fails on checkpoints with KV sharing but no PLE.
        keep = torch.arange(ids.shape[1])
        with torch.no_grad():
            hidden = decoder(input_ids=ids, use_cache=False, logits_to_keep=keep).last_hidden_state
            logits = head(hidden[:, first:])[0].float()
            if self.args.final_softcap:
                logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits

    # --- MLX checkpoints (llmexport/source/importers/mlx) ------------------------------------------------
    @classmethod
    def mlx_layout(cls, config: dict[str, Any]) -> MlxLayout:
        """mlx-lm's port (names.py): the text decoder under its own prefix, HF's stacked
        experts as SwitchGLU's (``MLX_EXPERTS``), and the vision/audio towers dropped (so are their
        configs here)."""
        kind = _kind(config.get("model_type"))
        hf, mlx = TEXT.bind(prefix=TEXT_PREFIX[kind]), MLX_TEXT.bind(prefix=MLX_TEXT_PREFIX[kind])
        experts = [rename_rule(mlx.pattern(key), hf.pattern(target), part=part)
                   for key, (target, part) in MLX_EXPERTS.items()]
        return MlxLayout((
            *experts,
            prefix_rule(MLX_TEXT_PREFIX[kind], TEXT_PREFIX[kind]),
            prefix_rule(mlx.name("lm_head") + ".", hf.name("lm_head") + "."),
        ), dropped_config=("vision_config", "audio_config"))
