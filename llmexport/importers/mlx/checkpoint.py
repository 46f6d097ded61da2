"""An MLX checkpoint opened as the HF checkpoint it was converted from."""

from __future__ import annotations

from typing import Any, Callable

import torch

from llmexport.checkpoint import Checkpoint, build_from_config
from llmexport.errors import InputError
from llmexport.importers.mlx.format import MLX_KEYS, MlxQuantConfig, mlx_quantization
from llmexport.importers.mlx.weights import MlxWeights
from llmexport.spec import MlxLayout


class MlxCheckpoint(Checkpoint):
    """An MLX checkpoint seen as the HF checkpoint it was converted from: HF tensor names,
    dequantized values, and a config without the MLX keys and the parts mlx-lm dropped."""

    def __init__(self, base: Checkpoint, layout: MlxLayout):
        where = str(base.path / "config.json")
        block = mlx_quantization(base.config)
        if block is None:
            raise InputError(f"{where}: no MLX 'quantization' block")
        self.quant = MlxQuantConfig(block, where)
        self.source_config = base.config
        config = {k: v for k, v in base.config.items() if k not in MLX_KEYS + layout.dropped_config}
        super().__init__(base.path, config, MlxWeights(base.weights, layout, self.quant, str(base.path)))

    def from_pretrained(self, loader: Any, **kwargs: Any) -> torch.nn.Module:
        """The HF model built from the config, carrying the dequantized tensors (fp32)."""
        model = build_from_config(loader, self.hf_config(bool(kwargs.get("trust_remote_code", False))), **kwargs)
        self._load_into(model)
        return model

    def hf_config(self, trust_remote_code: bool = False) -> Any:
        """The config without the MLX keys (and the parts mlx-lm dropped), as transformers' object."""
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
            raise InputError(f"{self.path}: the MLX checkpoint lacks {len(missing)} tensor(s) the HF model needs, "
                             f"e.g. {missing[0]!r}")


def adapt_checkpoint(checkpoint: Checkpoint,
                     layout_for: Callable[[dict[str, Any]], MlxLayout | None]) -> Checkpoint:
    """``checkpoint`` itself, or its HF view when it is MLX-quantized; ``layout_for`` gives the
    family's layout for a config (``Architecture.mlx_layout``), None where it has none."""
    if mlx_quantization(checkpoint.config) is None:
        return checkpoint
    layout = layout_for(checkpoint.config)
    if layout is None:
        raise InputError(f"{checkpoint.path}: MLX-quantized {checkpoint.model_type!r} checkpoints are not supported "
                         "(the family declares no MLX layout)")
    return MlxCheckpoint(checkpoint, layout)
