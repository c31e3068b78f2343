"""`belayer bench checkpoint`: its options and output; the benchmark itself is `belayer.bench.checkpoint`."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

from belayer.bench.checkpoint import DEFAULT_WORKLOAD, Bench, Sample, print_report, schedule, summarize
from belayer.bench.overhead import load_trace_task
from belayer.cli.bench.overhead import trace_task_options
from belayer.config import load_config
from belayer.measure import machine_load
from belayer.sandbox.host import make_host


@click.command("checkpoint")
@trace_task_options(DEFAULT_WORKLOAD)
@click.option(
    "--repetitions",
    type=click.IntRange(1, 100),
    default=3,
    show_default=True,
    help="Checkpoint + restore by each mode per repetition, modes interleaved.",
)
@click.option(
    "--compression",
    type=click.Choice(["zstd", "gzip", "none"]),
    default=None,
    help="Belayer's archive compression [default: sandbox.checkpoint_compression].",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.pass_context
def checkpoint(ctx: click.Context, workload: Path, task_id: str | None, repetitions: int,
               compression: str | None, as_json: bool) -> None:  # fmt: skip
    """One sandbox's full checkpoint and restore: Belayer against plain podman + CRIU, by phase.

    Needs root, podman + CRIU (`make install`) and the object store (`belayer up`).
    """

    config = load_config((ctx.obj or {}).get("config_file"))
    if compression:
        config = config.model_copy(
            update={"sandbox": config.sandbox.model_copy(update={"checkpoint_compression": compression})}
        )
    task = load_trace_task(workload, task_id)
    err = Console(stderr=True)
    bench = Bench(make_host(config), say=lambda m: err.print(m, highlight=False))
    load = machine_load()
    samples: list[Sample] = []
    try:
        bench.set_up(task)
        for rep, mode in schedule(repetitions):
            samples.append(bench.run(mode))
            s = samples[-1]
            err.print(
                f"repetition {rep + 1}/{repetitions} {mode:8} checkpoint {s.checkpoint_s:.2f}s "
                f"({s.archive_mb:.1f} MiB)  restore {s.restore_s:.2f}s"
                f"{'' if s.consistent else '  INCONSISTENT /workspace'}",
                highlight=False,
            )
    finally:
        bench.tear_down()
    report = summarize(samples, repetitions, config.sandbox.checkpoint_compression)
    report["machine"] = load | {"after": machine_load()["load_avg"]}
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_report(report)
