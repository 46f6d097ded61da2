"""``python -m llmexport.tiny OUT [--shape e2b]``: write a tiny random Gemma4 checkpoint."""

from __future__ import annotations

import click

from llmexport.tiny.gemma4 import SHAPES, build_tiny_gemma4


@click.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="e2b", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def main(out: str, shape: str, seed: int) -> None:
    """Build a tiny random Gemma4 checkpoint (config, safetensors, tokenizer) in OUT."""
    build_tiny_gemma4(out, shape, seed=seed)
    click.echo(f"wrote tiny Gemma4 '{shape}' checkpoint to {out}")


if __name__ == "__main__":
    main()
