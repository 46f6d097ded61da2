"""PEFT LoRA adapters (``--lora_path``) merged into a checkpoint's weights as they stream.

``LoraAdapter.open`` reads ``adapter_config.json`` and ``adapter_model.safetensors`` and matches
every adapter tensor to a checkpoint tensor; ``LoraWeights`` is the checkpoint's ``WeightStore``
with the adapter merged, which the family, the export, calibration and ``--verify``'s HF
reference all read, so they all see the same merged values (llmexport.source.loading puts it in place).
"""

from llmexport.source.lora.adapter import PEFT_PREFIX, LoraAdapter, LoraWeights, adapter_of, unmerged
from llmexport.source.lora.config import CONFIG_FILE, WEIGHTS_FILE, LoraConfig
from llmexport.source.lora.merge import Delta, MergedLazy, merged

__all__ = ["CONFIG_FILE", "PEFT_PREFIX", "WEIGHTS_FILE", "Delta", "LoraAdapter", "LoraConfig", "LoraWeights",
           "MergedLazy", "adapter_of", "merged", "unmerged"]
