"""Qwen3-VL (``qwen3_vl``): the Qwen3 text decoder with M-RoPE and DeepStack, and its vision tower."""
