"""Qwen3-VL-MoE family: ``qwen3_vl_moe`` (Qwen3VLMoeForConditionalGeneration): Qwen3-VL (family.py:
M-RoPE, DeepStack, the same vision tower) whose text decoder is Qwen3-MoE's, read through
transformers' ``Qwen3VLMoeTextConfig``.

Mirrors transformers 5.x models/qwen3_vl_moe/modeling_qwen3_vl_moe.py:
- ``Qwen3VLMoeTextTopKRouter`` always renormalises the top-k softmax weights (the config has no
  ``norm_topk_prob``), so the export does too whatever config.json says;
- ``Qwen3VLMoeTextExperts`` holds the experts stacked, ``gate_up_proj`` [E, 2 * width, hidden]
  (gate rows first) and ``down_proj`` [E, hidden, width]; each expert reads its row as one fused
  gate_up linear and down (decoder/names.py ``STACKED_EXPERT``);
- the released checkpoints store those stacks transposed, [E, hidden, 2 * width] and
  [E, width, hidden]: transformers' conversion_mapping.py (``qwen3_vl_moe``) transposes a stored
  tensor on load exactly when its shape differs from the in-memory one (``Transpose(1, 2,
  check_dims=True)``), and ``save_pretrained`` writes the in-memory layout. The family reads
  either, by the same rule (``transposed_stacks``); the reference gets the stored values
  transposed back where they were (``reference_transposed``).
"""

from __future__ import annotations

from typing import Any

from llmexport.mnn.config import Precision
from llmexport.models.decoder.names import STACKED_EXPERT
from llmexport.models.qwen3_vl.family import QWEN3_VL_NAMES, Qwen3VL
from llmexport.models.tensor_names import LinearList, NameTable, match

PREFIX = "model.language_model.layers.{layer}.mlp.experts."
#: Qwen3-VL's names, the routed experts as rows of transformers' stacked tensors
QWEN3_VL_MOE_NAMES = QWEN3_VL_NAMES.extended({
    "moe.expert.gate_up": PREFIX + "{expert}.gate_up_proj",
    "reference.experts.gate_up": PREFIX + "gate_up_proj",  # [E, 2 * width, hidden] (released: [E, hidden, 2 * width])
    "reference.experts.down": PREFIX + "down_proj",  # [E, hidden, width] (released: [E, width, hidden])
}, stacked={"moe.expert.gate_up": "reference.experts.gate_up", "moe.expert.down": "reference.experts.down"})


def transposed_stacks(names: NameTable, weights: Any, shapes: dict[str, tuple[int, int]]) -> list[str]:
    """The ``STACKED_EXPERT`` keys whose stored stacks are [E, in, out] (``shapes``: key -> the
    expert linear's (out, in)), judged as transformers does: by the first stack's shape, differing
    from the in-memory [E, out, in]. A layout the tensor check does not then accept is its error."""
    transposed = []
    stored = {name: tuple(weights.shape(name)) for name in weights.names()}
    for key in STACKED_EXPERT:
        pattern = names.pattern(names.stacked[key])
        found = next((shape for name, shape in stored.items() if match(pattern, name) is not None), None)
        out_features, in_features = shapes[key]
        if found is not None and found[1:] == (in_features, out_features) and out_features != in_features:
            transposed.append(key)
    return transposed


class Qwen3VLMoe(Qwen3VL):
    #: fp32 activations: fp16 flips router choices on MNN's ARM kernels (as Qwen3-MoE, qwen3.py)
    precision = Precision.NORMAL
    family = "Qwen3-VL-MoE"
    config_class = "Qwen3VLMoeTextConfig"
    names = QWEN3_VL_MOE_NAMES
    stacked_experts = True

    def text_config(self, raw: dict[str, Any], where: str) -> dict[str, Any]:
        return {**super().text_config(raw, where), "norm_topk_prob": True}  # Qwen3VLMoeTextTopKRouter

    def _collect_linears(self) -> LinearList:
        a = self.args
        if a.moe is not None:
            shapes = {"moe.expert.gate_up": (2 * a.moe.width, a.hidden_size),
                      "moe.expert.down": (a.hidden_size, a.moe.width)}
            self.names = QWEN3_VL_MOE_NAMES.with_transposed(transposed_stacks(self.names, self.checkpoint.weights,
                                                                              shapes))
        return super()._collect_linears()

    def reference_transposed(self, tensor: str) -> bool:
        return any(match(self.names.pattern(self.names.stacked[key]), tensor) is not None
                   for key in self.names.transposed)

    def reference_loader(self) -> Any:
        import transformers

        return transformers.Qwen3VLMoeForConditionalGeneration
