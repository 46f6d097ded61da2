"""A pre-quantized checkpoint opened as the HF checkpoint it came from: its config without the
quantizer's keys, its tensors under HF names, dequantized (the importer's ``WeightStore``)."""

from __future__ import annotations

from typing import Any

import torch

from llmexport.errors import InputError
from llmexport.source.checkpoint import Checkpoint, build_from_config
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
