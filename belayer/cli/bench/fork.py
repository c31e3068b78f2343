"""`belayer bench fork`: its options and output; the benchmark itself is `belayer.bench.fork`."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from belayer.bench.fork import run_bench
from belayer.config import load_config
from belayer.measure import machine_load
from belayer.sandbox.localstore import LocalDirStore


@click.command("fork")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "-g",
    "--group-size",
    default=8,
    show_default=True,
    type=click.IntRange(2, 64),
    help="Sandboxes a group needs (G).",
)
@click.option(
    "--repetitions",
    default=3,
    show_default=True,
    type=click.IntRange(1, 50),
    help="Repetitions of each mode (modes interleaved, order rotated).",
)
@click.option(
    "--scale",
    type=click.FloatRange(0.01, 10),
    default=1.0,
    show_default=True,
    help="Scale the setup's data (rows, files).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 64),
    default=None,
    help="Sandboxes started at once, in both modes [default: sandbox.fork_concurrency].",
)
@click.option(
    "--archive-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep checkpoints in this directory instead of the configured object store.",
)
@click.pass_context
def fork(ctx: click.Context, as_json: bool, group_size: int, repetitions: int, scale: float,
         concurrency: int | None, archive_dir: str | None) -> None:  # fmt: skip
    """Sandboxes for a group: fork of one set-up sandbox vs G independent create + setup, and
    a later group's fork vs containers of the set-up baked into an image."""
    config = load_config((ctx.obj or {}).get("config_file"))
    err = Console(stderr=True)
    store = None
    if archive_dir:
        store = LocalDirStore(Path(archive_dir))
    result = run_bench(config, group_size=group_size, repetitions=repetitions, scale=scale,
                       concurrency=concurrency, store=store, log_fn=lambda m: err.print(m, highlight=False))  # fmt: skip
    result["machine"] = machine_load()
    if as_json:
        click.echo(json.dumps(result))
        return

    table = Table(title=f"{group_size} sandboxes ready (seconds; min / median / max of {repetitions})")
    for col in ("mode", "ready", "peak memory MiB", "peak disk MiB"):
        table.add_column(col)
    for mode in ("fork_reused", "baked", "fork", "independent"):
        row = result[mode]
        table.add_row(mode, *(f"{row[k]['min']:.2f} / {row[k]['median']:.2f} / {row[k]['max']:.2f}"
                              for k in ("ready_s", "peak_memory_mb", "peak_disk_mb")))  # fmt: skip
    Console().print(
        f"a later group: a fork of its set-up checkpoint is ready {result['speedup_reused_vs_baked']}x as fast "
        f"as containers of the set-up baked into an image (medians; the bake took {result['bake_s']}s once)"
    )
    Console().print(table)
    err.print(
        f"speedup {result['speedup']}x (median); identical start: {result['identical_start']}; "
        f"fork = setup {result['fork']['setup_s']['median']:.2f}s + checkpoint "
        f"{result['fork']['checkpoint_s']['median']:.2f}s + forks {result['fork']['fork_s']['median']:.2f}s"
    )
