"""Qwen3-VL family: ``qwen3_vl`` (Qwen3VLForConditionalGeneration): the text model as Qwen3's
dense decoder on M-RoPE positions with DeepStack (qwen3_vl/graph.py), the vision tower as
``visual.mnn`` with the DeepStack levels as its second output (qwen_vl/vision.py, towers.py: the
same tower family as Qwen3.5's).

The text model sits under ``model.language_model.`` (Qwen3VLModel.language_model) and its config
under ``text_config``, read through transformers' ``Qwen3VLTextConfig``; whether the head is tied
is the outer config's (Qwen3VLConfig.tie_word_embeddings). ``mrope_section`` defaults to
Qwen3VLTextRotaryEmbedding's [24, 20, 20]; HF interleaves the rows whatever
``mrope_interleaved`` says (it is ignored at validation), so the graph does too. The reference is
the conditional-generation model in fp32, whose tensor names are the checkpoint's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmexport.errors import InputError
from llmexport.models.decoder.args import NO_SLIDING, resolve_config
from llmexport.models.decoder.names import LLAMA_LAYOUT
from llmexport.models.qwen3 import Qwen3
from llmexport.models.qwen3_vl.graph import Qwen3VLGraph
from llmexport.models.qwen_vl.mrope import mrope_section
from llmexport.models.qwen_vl.towers import QwenVisionTower
from llmexport.models.tensor_checks import finite_lookup
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import GraphInputs

#: the Llama layout under the multimodal model's text model
QWEN3_VL_NAMES = LLAMA_LAYOUT.moved("model.", "model.language_model.")
MROPE_SECTION = [24, 20, 20]  # Qwen3VLTextRotaryEmbedding's default


class Qwen3VLVisionTower(QwenVisionTower):
    """Qwen3.5's tower with DeepStack mergers (qwen_vl/vision.py)."""

    deepstack = True


class Qwen3VL(Qwen3):
    family = "Qwen3-VL"
    config_class = "Qwen3VLTextConfig"
    names = QWEN3_VL_NAMES
    sliding = NO_SLIDING
    _towers: list[Qwen3VLVisionTower]

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        import transformers

        where = str(checkpoint.path / "config.json")
        cfg = resolve_config(getattr(transformers, self.config_class), self.text_config(checkpoint.config, where),
                             where)
        #: rotary pairs per position row (t, h, w)
        self.mrope_section = mrope_section(cfg["rope_parameters"], f"{where}: text_config: rope_parameters",
                                           MROPE_SECTION)

    def text_config(self, raw: dict[str, Any], where: str) -> dict[str, Any]:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise InputError(f"{where}: 'text_config' must be an object (the text model's config)")
        return {**text, "tie_word_embeddings": raw.get("tie_word_embeddings", False)}

    def build_towers(self) -> list[Any]:
        vision = self.checkpoint.config.get("vision_config")
        if not isinstance(vision, dict):
            raise InputError(f"{self.checkpoint.path / 'config.json'}: 'vision_config' must be an object "
                             "(the vision tower's config)")
        return [Qwen3VLVisionTower(self, vision)]

    @property
    def levels(self) -> int:
        """The DeepStack levels the tower gives the text graph."""
        return len(self._towers[0].args.deepstack)

    def build_graph(self) -> nn.Module:
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        return Qwen3VLGraph(self.args, self.names, lookup, self.mrope_section, self.levels,
                            self.stacked_experts).eval()

    def graph_inputs(self, seq_len: int) -> GraphInputs:
        """The standard inputs with the runtime's three M-RoPE rows [3, seq] as ``position_ids``,
        then ``deepstack_embeds`` [levels, seq, hidden] (llm.cpp loads the graph with that fifth
        input name when llm_config says ``has_deepstack``; every axis is free: a decode step
        feeds [3, 1, 1])."""
        inputs = super().graph_inputs(seq_len)
        args = list(inputs.args)
        args[2] = torch.arange(seq_len, dtype=torch.int32).view(1, -1).repeat(3, 1)
        args.append(torch.randn(self.levels, seq_len, self.args.hidden_size))
        axes = inputs.dynamic_axes | {"deepstack_embeds": {0: "levels", 1: "deepstack_seq", 2: "deepstack_width"}}
        return GraphInputs(tuple(args), [*inputs.names, "deepstack_embeds"], axes, inputs.output_names)

    def llm_config(self) -> dict[str, Any]:
        return super().llm_config() | {"is_mrope": True}

    def reference_loader(self) -> Any:
        import transformers

        return transformers.Qwen3VLForConditionalGeneration
