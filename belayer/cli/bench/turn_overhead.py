"""`belayer bench turn-overhead`: its options and output;
the benchmark itself is `belayer.bench.turn_overhead`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
from rich.console import Console

from belayer.bench.overhead import load_trace_task
from belayer.bench.turn_overhead import DEFAULT_WORKLOAD, print_report, run_bench
from belayer.cli.bench.output import report_and_exit
from belayer.cli.bench.overhead import trace_task_options
from belayer.cli.context import config_from


@click.command("turn-overhead")
@trace_task_options(DEFAULT_WORKLOAD)
@click.option(
    "--repetitions",
    default=3,
    show_default=True,
    type=click.IntRange(1, 50),
    help="Runs of each mode, interleaved; figures are min / median / max.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.pass_context
def turn_overhead(
    ctx: click.Context, workload: Path, task_id: str | None, repetitions: int, as_json: bool
) -> None:
    """Per-turn orchestration cost of Belayer's workflow against a plain asyncio loop.

    Needs the running stack (`belayer up`); the plain loop starts its own engine with the
    rollout node's model and settings, and its own sandbox on this host.
    """
    config = config_from(ctx.find_root())
    task = load_trace_task(workload, task_id)
    err = Console(stderr=True)
    report = asyncio.run(run_bench(config, task, repetitions, lambda m: err.print(m, highlight=False)))
    report_and_exit(report, as_json=as_json, print_table=print_report)
