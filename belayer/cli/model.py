"""`belayer model ...`: build the project's own model into the cache, and export a
training run's weights as a model folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from belayer.cli.context import config_from
from belayer.config import load_config
from belayer.model.build import MODEL_NAMES, build_model


@click.group("model")
def model() -> None:
    """The project-built causal LM (deterministic, no download), and trained weights exported from it."""


@model.command("build")
@click.option(
    "--size",
    type=click.Choice(list(MODEL_NAMES)),
    default="tiny",
    show_default=True,
    help="tiny-warm, tiny-agent: tiny after a supervised warm start on the learn or the "
    "multistep tasks (builds tiny first; a few minutes on 2 cores).",
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

    if cache_dir is None:
        cache_dir = load_config().cache_dir
    path = build_model(
        size, cache_dir, force=force, progress=lambda msg: click.echo(f"[model] {msg}", err=True)
    )
    click.echo(str(path))


@model.command("export")
@click.argument("run_id", metavar="RUN")
@click.option(
    "--iteration",
    type=click.IntRange(0),
    default=None,
    help="The iteration whose trained weights to export (default: the last one recorded).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="The folder to write; it must not exist or be empty.",
)
@click.option("--force", is_flag=True, help="Replace --out, and everything in it, when it is not empty.")
@click.pass_context
def export(ctx: click.Context, run_id: str, iteration: int | None, out: Path, force: bool) -> None:
    """Write training run RUN's weights after an iteration as a safetensors model folder
    (config.json, tokenizer, model.safetensors in fp32) that vLLM and transformers load;
    print the folder.

    The weights are read from the iteration's write-once trainer checkpoint and checked
    against the sha256s its record names: model.safetensors' sha256 is the iteration's
    weights sha256 (`belayer train status RUN`).
    """
    from belayer.export import export_run  # import cost: torch, ~2.5 s

    exported = export_run(
        config_from(ctx.find_root()),
        run_id,
        out,
        iteration=iteration,
        force=force,
        progress=lambda msg: click.echo(f"[model] {msg}", err=True),
    )
    click.echo(
        f"[model] run {run_id} iteration {exported.iteration}: weights v{exported.weights_version} "
        f"sha256 {exported.weights_sha256} ({exported.model})",
        err=True,
    )
    click.echo(str(out))
    sys.stdout.flush()
    os._exit(0)  # the Temporal SDK can abort at interpreter exit in short commands (docs/design.md §7)
