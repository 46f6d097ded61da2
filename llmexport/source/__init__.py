"""Where the weights come from: a HF folder or hub id, its safetensors, a pre-quantized
checkpoint's importer, a LoRA adapter, and the family opened over them."""
