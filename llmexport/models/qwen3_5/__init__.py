"""Qwen3.5: Gated DeltaNet and gated full-attention layers, dense or MoE, text or multimodal layout."""
