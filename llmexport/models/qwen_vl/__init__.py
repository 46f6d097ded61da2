"""What the Qwen vision-language families share (Qwen3.5, Qwen3-VL): the vision tower (vision.py,
towers.py) and the runtime's M-RoPE positions made HF's (mrope.py)."""
