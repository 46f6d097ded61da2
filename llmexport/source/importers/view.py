"""A pre-quantized checkpoint opened as the HF checkpoint it came from: its config without the
quantizer's keys, its tensors under HF names, dequantized (the importer's ``WeightStore``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterator

import numpy as np
import torch

from llmexport.errors import InputError
from llmexport.source.checkpoint import Checkpoint, build_from_config
from llmexport.source.safetensors_file import LazyTensor
from llmexport.spec import WeightStore


class ImportedCheckpoint(Checkpoint):
    """``base``'s folder with ``config`` (the quantizer's keys taken out) and ``weights`` (HF names,
    fp32 values where the source stored integers). transformers never sees the quantized format:
    the HF model is built from the plain config and filled with the dequantized tensors."""

    def __init__(self, base: Checkpoint, config: dict[str, Any], weights: WeightStore):
        super().__init__(base.path, config, weights)

    def from_pretrained(self, loader: Any, **kwargs: Any) -> torch.nn.Module:
        """The HF model built from the config, carrying the dequantized tensors (fp32)."""
        model = build_from_config(loader, self.hf_config(bool(kwargs.get("trust_remote_code", False))), **kwargs)
        self._load_into(model)
        return model

    def hf_config(self, trust_remote_code: bool = False) -> Any:
        """The config without the quantizer's keys, as transformers' object."""
        from transformers import AutoConfig

        config = type(AutoConfig.from_pretrained(self.path, trust_remote_code=trust_remote_code)).from_dict(self.config)
        config._name_or_path = str(self.path)  # where remote code is found
        return config

    def _load_into(self, model: torch.nn.Module) -> None:
        state = model.state_dict(keep_vars=True)
        loaded: set[int] = set()
        with torch.no_grad():
            for name in self.weights.names():
                if name not in state:
                    raise InputError(f"{self.path}: tensor {name!r} has no place in the HF model")
                state[name].copy_(self.weights.tensor(name))
                loaded.add(state[name].data_ptr())
        missing = [k for k, v in state.items() if v.data_ptr() not in loaded]
        if missing:
            raise InputError(f"{self.path}: the checkpoint lacks {len(missing)} tensor(s) the HF model needs, "
                             f"e.g. {missing[0]!r}")


class WholeLazy(LazyTensor, ABC):
    """An importer's HF tensor that is decoded whole (``read``, fp32): rows and row chunks are
    slices of it (GPTQ packs along the input axis, AWQ mixes output columns within a word, GGUF
    permutes q/k rows)."""

    shape: torch.Size
    dtype = torch.float32

    @property
    def row_bytes(self) -> int:
        return max(1, int(np.prod(self.shape[1:], dtype=np.int64)) * 4)

    @abstractmethod
    def read(self) -> torch.Tensor: ...

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.read()[start:stop]

    def row_chunks(self, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        value = self.read()
        step = max(1, max_bytes // self.row_bytes)
        for start in range(0, self.shape[0], step):
            yield value[start:start + step]
