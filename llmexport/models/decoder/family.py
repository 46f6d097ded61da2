"""What a decoder family shares when its placeholder linears map onto checkpoint tensors by name.

``DecoderFamily`` implements the bookkeeping of ``Architecture`` from the family's name table
(tensor_names.py), the linears it lists with their checkpoint tensors (``LinearList``: a weight,
or a row of a stacked expert tensor) and a few hooks: the graph constants and tables the config
implies. From them come the expected-tensor check, the weights and MLX sources of the linears,
the embedding table, the stored weights written into the HF reference, the reference itself and
its logits, the standard graph inputs and the checkpoint's own chat template. A family overrides
only what differs (Gemma4: its graph inputs, reference logits, template).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from llmexport.models.base import Architecture, Tower
from llmexport.models.tensor_checks import Shapes, check_tensors
from llmexport.models.tensor_names import LinearList, NameTable
from llmexport.source.input_files import TOKENIZER_LIMIT, read_bytes, read_optional_json
from llmexport.spec import (
    UNTIED_HEAD,
    ExpertTemplate,
    GraphInputs,
    LazyRows,
    LinearRole,
    LinearSource,
    LinearSpec,
    ReferenceTensors,
)

#: what the placeholder names of an expert template hold in place of an expert's module path
EXPERT_MARKER = "@expert@"


def expert_template(names: NameTable, module: str, linears: Sequence[str],
                    build: Callable[[tuple[str, ...]], nn.Module], hidden: int,
                    instances: Iterable[tuple[int, int, int]], marker: str = EXPERT_MARKER) -> ExpertTemplate:
    """Routed experts exported as one template: ``build`` makes the expert module from the names
    of its ``linears`` (table keys) with the expert ``module``'s path replaced by ``marker``;
    ``instances``: (MoE layer_id, layer, expert), each of which puts its path back."""
    template = build(tuple(names.template(key, module, marker) for key in linears)).eval()
    return ExpertTemplate(template, marker, hidden, tuple((layer_id, e, names.name(module, layer=layer, expert=e))
                                                          for layer_id, layer, e in instances))


class DecoderFamily(Architecture):
    """Base of the families here. Subclasses set ``family`` (the name in messages) and ``names``
    (their tensor-name table), build ``self.args`` (with ``tie_embeddings`` and
    ``vocab_size``/``hidden_size``) and ``self._linears`` (``add_head`` for the lm_head), then call
    ``check_weights``."""

    family: str = ""
    #: the towers a multimodal family exports beside the text graph, set before ``check_weights``
    #: (each lists its checkpoint tensors: ``expected_tensors``)
    _towers: Sequence[Any] = ()
    #: the family's checkpoint tensor names (llmexport/models/tensor_names.py)
    names: NameTable
    #: the family's parsed config (a frozen dataclass with at least ``vocab_size``, ``hidden_size``)
    args: Any
    #: checkpoint tensors the export does not need and may ignore (e.g. ``rotary_emb.inv_freq``)
    ignored_suffixes: tuple[str, ...] = ()
    _linears: LinearList

    # --- hooks --------------------------------------------------------------------------------
    @property
    def embedding_name(self) -> str:
        return self.names.name("embed")

    def stacked_count(self, tensor: str) -> int:
        """How many experts a stacked tensor holds (only asked for linears read by row)."""
        raise NotImplementedError(f"{type(self).__name__} stacks no experts")

    def constant_shapes(self) -> Shapes:
        """Small tensors that become graph constants (norm gammas, scalars, router biases)."""
        return {}

    def table_shapes(self) -> Shapes:
        """Tables read row by row (the token embedding, PLE)."""
        return {self.embedding_name: (self.args.vocab_size, self.args.hidden_size)}

    @property
    def sliding_window(self) -> int:
        """Keys a sliding layer sees; 0 when every layer is full attention. Otherwise the runtime
        runs "mix" attention: a [2, 1, 1, seq, kv] mask, slice 1 for the sliding layers."""
        return 0

    def add_head(self, linears: LinearList) -> None:
        """The lm_head, which reads the token embedding when the embeddings are tied."""
        tied = LinearSource(self.embedding_name) if self.tied_embedding else None
        linears.add("lm_head", self.args.hidden_size, self.args.vocab_size, LinearRole.LM_HEAD, source=tied)

    # --- weights ------------------------------------------------------------------------------
    def linears(self) -> list[LinearSpec]:
        return list(self._linears.specs)

    def expected_tensors(self) -> Shapes:
        expected: Shapes = dict(self.table_shapes())
        for spec in self._linears.specs:
            source = self.linear_source(spec.name)
            stack = (self.stacked_count(source.weight),) if source.expert is not None else ()
            matrix = (spec.in_features, spec.out_features) if source.transposed else \
                (spec.out_features, spec.in_features)
            expected[source.weight] = stack + matrix
            if source.bias:
                expected[source.bias] = (spec.out_features,)
        for name, shape in self.constant_shapes().items():
            expected.setdefault(name, shape)
        for tower in self._towers:
            expected.update(tower.expected_tensors())
        return expected

    def towers(self) -> list[Tower]:
        return list(self._towers)

    def check_weights(self) -> None:
        check_tensors(self.checkpoint.weights, self.expected_tensors(), self.checkpoint.path, self.family,
                      ignored=self.ignored_tensor)

    def ignored_tensor(self, name: str) -> bool:
        """A checkpoint tensor the export does not need (by default: ``ignored_suffixes``)."""
        return name.endswith(self.ignored_suffixes)

    def linear_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        source = self.linear_source(name)
        weights = self.checkpoint.weights
        lazy = weights.lazy(source.weight)
        row = source.expert
        weight = lazy.read() if row is None else lazy.rows(row, row + 1)[0]
        return (weight.t().contiguous() if source.transposed else weight), \
            (weights.tensor(source.bias) if source.bias else None)

    def linear_source(self, name: str) -> LinearSource:
        return self._linears.source(name, self.family)

    @property
    def tied_embedding(self) -> bool:
        return self.args.tie_embeddings

    def embedding_table(self) -> LazyRows:
        return self.checkpoint.weights.lazy(self.embedding_name)

    # --- graph --------------------------------------------------------------------------------
    def graph_inputs(self, seq_len: int) -> GraphInputs:
        """The runtime's inputs: one full-attention mask, or the "mix" pair with sliding layers."""
        mask = torch.zeros((2, 1, 1, seq_len, seq_len) if self.sliding_window else (1, 1, seq_len, seq_len))
        args = (torch.randn(seq_len, 1, self.args.hidden_size), mask,
                torch.arange(seq_len, dtype=torch.int32).view(1, -1), torch.tensor([-1], dtype=torch.int32))
        axes = {"input_ids": {0: "seq_len"}, "attention_mask": {mask.dim() - 2: "seq_len", mask.dim() - 1: "kv_len"},
                "position_ids": {1: "seq_len"}}
        return GraphInputs(args, ["input_ids", "attention_mask", "position_ids", "logits_index"], axes,
                           ["logits", "hidden_states"])

    # --- runtime files ------------------------------------------------------------------------
    def full_attention_config(self, model_type: str) -> dict[str, Any]:
        """llm_config.json of a decoder with the checkpoint's own chat template: full attention, or
        "mix" with the window when layers slide (``sliding_window``). ``attn_scale`` is left to
        the runtime default 1/sqrt(head_dim), which is the family's (the graph's Attention ops
        carry the same scale)."""
        a = self.args
        attention = "mix" if self.sliding_window else "full"
        config: dict[str, Any] = {"model_type": model_type, "hidden_size": a.hidden_size,
                                  "layer_nums": a.num_layers, "attention_type": attention,
                                  "max_position_embeddings": a.max_position_embeddings}
        if self.sliding_window:
            config["sliding_window"] = self.sliding_window
        jinja = self.runtime_chat_template()
        if jinja:
            config["jinja"] = jinja
        return config

    def runtime_chat_template(self) -> dict[str, Any] | None:
        """llm_config.json's ``jinja`` block: the checkpoint's own template (a family whose real
        template the runtime renders differently returns its runtime form)."""
        return self.checkpoint_chat_template()

    def checkpoint_chat_template(self) -> dict[str, str] | None:
        """The checkpoint's own chat template (``chat_template.jinja`` over tokenizer_config.json's)
        with its bos and eos strings, passed through unchanged."""
        path = self.checkpoint.path
        tok_config = read_optional_json(path / "tokenizer_config.json", TOKENIZER_LIMIT, "tokenizer config") or {}
        template = tok_config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = read_bytes(path / "chat_template.jinja", TOKENIZER_LIMIT, "chat template").decode("utf-8")
        if not isinstance(template, str):
            return None
        out = {"chat_template": template}
        for key in ("bos", "eos"):
            token = tok_config.get(f"{key}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                out[key] = token
        return out

    # --- reference ----------------------------------------------------------------------------
    def reference_loader(self) -> Any:
        """The transformers class (or Auto class) whose ``from_pretrained`` builds the reference."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def reference_kwargs(self, trust_remote_code: bool) -> dict[str, Any]:
        return {"attn_implementation": "eager"}

    def load_reference(self, stored: ReferenceTensors | None, trust_remote_code: bool = False) -> nn.Module:
        model = self.checkpoint.from_pretrained(self.reference_loader(), dtype=torch.float32,
                                                **self.reference_kwargs(trust_remote_code))
        model.eval()
        if stored is not None:
            self.load_tensors(model, stored)
        return model

    def empty_reference(self, trust_remote_code: bool = False) -> nn.Module:
        return self.checkpoint.empty_model(self.reference_loader(), dtype=torch.float32,
                                           **self.reference_kwargs(trust_remote_code))

    def reference_slot(self, tensor: str) -> tuple[str, tuple[Any, ...]]:
        return tensor, ()

    def load_tensors(self, model: nn.Module, tensors: ReferenceTensors) -> None:
        """Every tensor of ``tensors`` copied into the reference (its place: ``reference_slot``);
        an untied head (``UNTIED_HEAD``) unties a tied model first."""
        if UNTIED_HEAD in tensors and self.tied_embedding:
            untie_lm_head(model)
        state = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for tensor in tensors.names():
                name, index = self.reference_slot(tensor)
                if name not in state and self.ignored_tensor(tensor):
                    continue
                value = tensors.read(tensor)
                state[name][index].copy_(value.transpose(-1, -2) if self.reference_transposed(tensor) else value)

    def reference_logits(self, model: nn.Module, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids.view(1, -1), use_cache=False,
                         logits_to_keep=torch.arange(first, ids.numel())).logits[0].float()


def untie_lm_head(model: Any) -> None:
    """Give an HF model's lm_head its own copy of the tied embedding (and keep transformers from
    tying them again)."""
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False
