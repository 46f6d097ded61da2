"""Media preprocessing for multimodal towers, written to match HF's processors exactly.

``image``: Gemma4's PIL image processor (aspect-preserving bicubic resize to multiples of 48,
rescale, 16x16 patches, (x, y) patch positions, padding to the patch budget) and the size
helper that makes MNN's runtime resize an identity. ``audio``: Gemma4's log-mel feature
extractor, and the runtime's own framing (``usm_fbank``) for comparing against it.
"""
