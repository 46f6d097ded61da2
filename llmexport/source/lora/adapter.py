"""A PEFT LoRA adapter opened against a checkpoint's tensors, and those tensors with it merged.

PEFT saves a trained adapter's tensors under the HF model's module paths with ``base_model.model.``
in front (``peft/utils/save_and_load.py``): ``{module}.lora_A.weight [r, in]`` and
``{module}.lora_B.weight [out, r]`` for an ``nn.Linear``, ``{module}.lora_embedding_A [r, vocab]`` and
``{module}.lora_embedding_B [dim, r]`` for an ``nn.Embedding``, and whole tensors (``modules_to_save``,
biases trained with ``bias="all"/"lora_only"``) under their own names; a targeted token table's
base weights come along as ``{module}.base_layer.weight`` (``save_embedding_layers``). A module path is the name of
its parameters in the checkpoint (``{module}.weight``) for every family here (the streamed
reference relies on the same equality), fused layouts included: an adapter on Phi-3's
``qkv_proj`` is merged into the fused weight, and Gemma4's decoder modules live under
``model.language_model.``. Anything that does not fit is refused, naming the adapter's key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmexport.errors import InputError
from llmexport.source.checkpoint import SafetensorsIndex
from llmexport.source.lora.config import CONFIG_FILE, WEIGHTS_FILE, LoraConfig
from llmexport.source.lora.merge import Delta, MergedLazy, ReplacedLazy
from llmexport.spec import LazyRows, WeightStore

#: the prefix PEFT's ``PeftModel`` puts before the HF model's module paths
PEFT_PREFIX = "base_model.model."
_FACTOR = re.compile(r"(?P<module>.+)\.(?:(?P<linear>lora_[AB])\.weight|(?P<table>lora_embedding_[AB]))")


@dataclass
class LoraAdapter:
    """An adapter resolved against a checkpoint: a ``Delta`` per merged tensor, a tensor of the
    adapter per replaced one (both keyed by checkpoint name)."""

    folder: Path
    config: LoraConfig
    deltas: dict[str, Delta] = field(default_factory=dict)
    replacements: dict[str, LazyRows] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: Path, base: WeightStore) -> LoraAdapter:
        """The adapter in ``folder`` (``adapter_config.json`` + ``adapter_model.safetensors``), every
        key matched to a tensor of ``base`` of the right shape (``InputError`` naming the key)."""
        if not folder.is_dir():
            raise InputError(f"{folder}: --lora_path is not a folder (expected a PEFT adapter: {CONFIG_FILE} "
                             f"and {WEIGHTS_FILE})")
        adapter = cls(folder, LoraConfig.read(folder))
        tensors = SafetensorsIndex.of_file(folder / WEIGHTS_FILE)
        factors: dict[tuple[str, bool], dict[str, str]] = {}
        for key in sorted(tensors.names()):
            if not key.startswith(PEFT_PREFIX):
                raise InputError(f"{folder / WEIGHTS_FILE}: {key!r} is not a PEFT adapter tensor "
                                 f"(expected names under {PEFT_PREFIX!r})")
            path = key[len(PEFT_PREFIX):]
            match = _FACTOR.fullmatch(path)
            if match is not None:
                side = (match["linear"] or match["table"])[-1]
                factors.setdefault((match["module"], match["table"] is not None), {})[side] = key
            elif ".lora_" in path or path.startswith("lora_"):
                raise InputError(f"{folder / WEIGHTS_FILE}: {key!r} is a LoRA tensor this merge does not know "
                                 "(DoRA magnitudes, lora_B biases and adapter-named keys are not supported)")
            else:  # PEFT saves a targeted token table's base weights as {module}.base_layer.weight
                adapter._replace(key, path.replace(".base_layer.", "."), tensors, base)
        for (module, embedding), sides in factors.items():
            adapter._add_delta(module, embedding, sides, tensors, base)
        if not adapter.deltas and not adapter.replacements:
            raise InputError(f"{folder / WEIGHTS_FILE}: holds no LoRA tensors")
        return adapter

    def _where(self) -> Path:
        return self.folder / WEIGHTS_FILE

    def _target(self, key: str, name: str, base: WeightStore) -> tuple[int, ...]:
        if name not in base:
            raise InputError(f"{self._where()}: {key!r}: the checkpoint has no tensor {name!r} (an adapter of "
                             "another model, or a module the export does not have)")
        return tuple(base.shape(name))

    def _replace(self, key: str, name: str, tensors: SafetensorsIndex, base: WeightStore) -> None:
        shape, own = self._target(key, name, base), tuple(tensors.shape(key))
        if own != shape:
            raise InputError(f"{self._where()}: {key!r} is {list(own)}, the checkpoint's {name!r} {list(shape)}")
        self.replacements[name] = tensors.lazy(key)

    def _add_delta(self, module: str, embedding: bool, sides: dict[str, str], tensors: SafetensorsIndex,
                   base: WeightStore) -> None:
        key = sides.get("A") or sides["B"]
        name = module + ".weight"
        shape = self._target(key, name, base)
        if set(sides) != {"A", "B"}:
            raise InputError(f"{self._where()}: {key!r} has no {'B' if 'A' in sides else 'A'} factor beside it")
        a, b = tuple(tensors.shape(sides["A"])), tuple(tensors.shape(sides["B"]))
        r, _ = self.config.rank_alpha(module)
        if len(shape) != 2:
            raise InputError(f"{self._where()}: {key!r}: the checkpoint's {name!r} is {list(shape)}, not a 2-D weight")
        rows, cols = shape
        expected = ((r, rows), (cols, r)) if embedding else ((r, cols), (rows, r))
        if (a, b) != expected:
            raise InputError(f"{self._where()}: {key!r}: factors {list(a)} and {list(b)} do not fit the checkpoint's "
                             f"{name!r} {list(shape)} at rank {r} (expected {list(expected[0])} and "
                             f"{list(expected[1])})")
        self.deltas[name] = Delta(key, tensors.lazy(sides["A"]), tensors.lazy(sides["B"]),
                                  self.config.scale(module), embedding)

    def targets(self) -> set[str]:
        """Checkpoint names of every tensor the adapter changes."""
        return set(self.deltas) | set(self.replacements)

    def key_of(self, name: str) -> str:
        """The adapter key behind a changed checkpoint tensor (for messages)."""
        return self.deltas[name].key if name in self.deltas else PEFT_PREFIX + name

    def summary(self) -> dict[str, Any]:
        """What manifest.json records of the adapter (beside its files' sha256)."""
        ranks = sorted({d.rank for d in self.deltas.values()})
        return {"path": str(self.folder), "r": self.config.r, "lora_alpha": self.config.alpha,
                "use_rslora": self.config.use_rslora, "ranks": ranks, "merged": len(self.deltas),
                "replaced": len(self.replacements), "base_model": self.config.base_model}

    def files(self) -> tuple[Path, Path]:
        return self.folder / CONFIG_FILE, self.folder / WEIGHTS_FILE


class LoraWeights:
    """A checkpoint's tensors with an adapter merged in (the ``WeightStore`` interface): the tensors
    it changes are merged (or replaced) as they are read, the others are the base's own."""

    def __init__(self, base: WeightStore, adapter: LoraAdapter):
        self.base, self.adapter = base, adapter
        self.folder = base.folder

    def names(self) -> list[str]:
        return self.base.names()

    def __contains__(self, name: str) -> bool:
        return name in self.base

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.base.dtype(name)

    def lazy(self, name: str) -> LazyRows:
        lazy = self.base.lazy(name)
        if name in self.adapter.replacements:
            lazy = ReplacedLazy(lazy, self.adapter.replacements[name])
        if name in self.adapter.deltas:  # on the base weights the adapter carries, if it does
            lazy = MergedLazy(lazy, self.adapter.deltas[name])
        return lazy

    def tensor(self, name: str) -> torch.Tensor:
        return self.lazy(name).read()


def adapter_of(weights: WeightStore) -> LoraAdapter | None:
    """The adapter merged into ``weights``, if any."""
    return weights.adapter if isinstance(weights, LoraWeights) else None


def unmerged(weights: WeightStore) -> WeightStore:
    """The tensors under an adapter's merge (``weights`` itself when there is none)."""
    return weights.base if isinstance(weights, LoraWeights) else weights
