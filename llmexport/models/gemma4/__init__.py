"""Gemma4: the text decoder (PLE, KV sharing, dual/partial RoPE, K=V, MoE), the vision and audio
towers, their media, checks and chat template."""
