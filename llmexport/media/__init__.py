"""Media preprocessing for multimodal towers, written to match HF's processors exactly.

``image``: Gemma4's PIL image processor (aspect-preserving bicubic resize to multiples of 48,
rescale, 16x16 patches, (x, y) patch positions, padding to the patch budget), and
``save_image_for_runtime``, which prepares an image so that MNN's runtime sees HF's pixels.
``audio``: Gemma4's log-mel feature extractor, the runtime's own framing (``usm_fbank``), and
``save_audio_for_runtime``, which pads a clip so that the runtime computes HF's frames.
"""
