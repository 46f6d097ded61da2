"""Tiny, deterministic stand-ins for real checkpoints (tokenizer, models) used by tests."""
