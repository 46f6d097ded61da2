"""An MLX checkpoint opened as the HF checkpoint it was converted from."""

from __future__ import annotations

from typing import Any, Callable

from llmexport.errors import InputError
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.importers.mlx.format import MLX_KEYS, MlxQuantConfig, mlx_quantization
from llmexport.source.importers.mlx.weights import MlxWeights
from llmexport.source.importers.view import ImportedCheckpoint
from llmexport.spec import MlxLayout


class MlxCheckpoint(ImportedCheckpoint):
    """An MLX checkpoint seen as the HF checkpoint it was converted from: HF tensor names,
    dequantized values, and a config without the MLX keys and the parts mlx-lm dropped."""

    def __init__(self, base: Checkpoint, layout: MlxLayout):
        where = str(base.path / "config.json")
        block = mlx_quantization(base.config)
        if block is None:
            raise InputError(f"{where}: no MLX 'quantization' block")
        self.quant = MlxQuantConfig(block, where)
        config = {k: v for k, v in base.config.items() if k not in MLX_KEYS + layout.dropped_config}
        super().__init__(base, config, MlxWeights(base.weights, layout, self.quant, str(base.path)))


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
