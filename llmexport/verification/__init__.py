"""Verification: MNN's runtime on the exported folder next to the HF references, judged by one rule."""
