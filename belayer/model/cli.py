"""`belayer model ...`: build the project's own model into the cache.

The CLI owner registers `model` on the main group (`main.add_command(model)`).
"""

from __future__ import annotations

from pathlib import Path

import click


@click.group("model")
def model() -> None:
    """The project-built causal LM (deterministic, no download)."""


@model.command("build")
@click.option(
    "--size",
    type=click.Choice(["tiny", "bench", "tiny-warm"]),
    default="tiny",
    show_default=True,
    help="tiny-warm: tiny after the supervised warm start (builds tiny first; ~2 min on 2 cores).",
)
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Cache root (default: the configured cache_dir, ~/.cache/belayer).",
)
@click.option("--force", is_flag=True, help="Rebuild even when a build is cached.")
def build(size: str, cache_dir: Path | None, force: bool) -> None:
    """Build the model of SIZE and print its folder."""
    from belayer.model.build import build_model

    if cache_dir is None:
        from belayer.config import load_config

        cache_dir = load_config().cache_dir
    path = build_model(
        size, cache_dir, force=force, progress=lambda msg: click.echo(f"[model] {msg}", err=True)
    )
    click.echo(str(path))
