"""`belayer bench storage`: its options and output; the benchmark itself is `belayer.bench.storage`."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

from belayer.bench.storage import result_table, run_storage_bench
from belayer.config import load_config
from belayer.measure import machine_load


@click.command("storage")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--size-mb", type=click.IntRange(1, 65536), default=256, show_default=True, help="File size in MiB."
)
@click.option(
    "--repetitions",
    type=click.IntRange(1, 50),
    default=3,
    show_default=True,
    help="Runs of each path (local copy, upload, download), interleaved; figures are min / median / max.",
)
@click.option(
    "--dir",
    "work_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the local files go (default: the system temp directory).",
)
@click.pass_context
def storage(ctx: click.Context, as_json: bool, size_mb: int, repetitions: int, work_dir: Path | None) -> None:
    """Upload and download MB/s through the object store, against a local disk copy."""
    config_file = (ctx.obj or {}).get("config_file")
    cfg = load_config(config_file).storage
    load = machine_load()
    result = run_storage_bench(
        cfg, size_mb=size_mb, repetitions=repetitions, work_dir=work_dir, console=Console(stderr=True)
    )
    result["machine"] = load | {"after": machine_load()["load_avg"]}
    if as_json:
        click.echo(json.dumps(result))
    else:
        Console().print(result_table(result))
