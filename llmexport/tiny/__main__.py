"""``python -m llmexport.tiny OUT [--shape e2b | --family MODEL_TYPE]``: write a tiny random checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from llmexport.tiny.gemma4 import SHAPES, build_tiny_gemma4
from llmexport.tiny.registry import TINY_BUILDERS


@click.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="e2b", show_default=True,
              help="Gemma4 shape (when no --family is given).")
@click.option("--family", type=click.Choice(sorted(TINY_BUILDERS)), default=None,
              help="Any registered model_type instead of Gemma4 (its default tiny variant).")
@click.option("--seed", type=int, default=0, show_default=True)
def main(out: str, shape: str, family: str | None, seed: int) -> None:
    """Build a tiny random checkpoint (config, safetensors, tokenizer) in OUT."""
    if family:
        TINY_BUILDERS[family](Path(out), seed)
        click.echo(f"wrote tiny '{family}' checkpoint to {out}")
        return
    build_tiny_gemma4(out, shape, seed=seed)
    click.echo(f"wrote tiny Gemma4 '{shape}' checkpoint to {out}")


if __name__ == "__main__":
    main()
