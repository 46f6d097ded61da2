"""LFM2 (Liquid AI): short-conv and attention layers interleaved, dense or with routed experts."""
