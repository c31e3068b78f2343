"""`belayer bench turn-throughput`: its options and output;
the benchmark itself is `belayer.bench.turn_throughput`."""

from __future__ import annotations

import asyncio

import click
from rich.console import Console

from belayer.bench.turn_throughput import CONCURRENCY, TURNS, print_report, run_bench
from belayer.cli.bench.output import report_and_exit
from belayer.cli.context import config_from


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of whole numbers, e.g. 1,16,64"
        ) from None
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{text!r}: every count must be at least 1")
    return counts


@click.command("turn-throughput")
@click.option(
    "--concurrency",
    default=",".join(map(str, CONCURRENCY)),
    show_default=True,
    help="Trajectories run at once, comma-separated; the report leads with the largest.",
)
@click.option(
    "--turns",
    default=",".join(map(str, TURNS)),
    show_default=True,
    help="SHORT,LONG: each trajectory count runs at both lengths; per turn is their difference.",
)
@click.option(
    "--repetitions",
    default=3,
    show_default=True,
    type=click.IntRange(1, 20),
    help="Runs of each mode, interleaved; figures are min / median / max.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.pass_context
def turn_throughput(
    ctx: click.Context, concurrency: str, turns: str, repetitions: int, as_json: bool
) -> None:
    """Control-plane CPU per turn and turns per second, Belayer against a plain asyncio loop.

    Needs the running stack (`belayer up`). The engine is scripted (no model forward pass);
    sandboxes are real. Exits 1 when the goal (10 CPU-ms per turn at the largest
    concurrency) is not met.
    """
    counts, lengths = _counts(concurrency), _counts(turns)
    if len(lengths) != 2 or lengths[0] >= lengths[1]:
        raise click.BadParameter(
            f"{turns!r}: give two lengths, SHORT,LONG with SHORT < LONG", param_hint="--turns"
        )
    config = config_from(ctx.find_root())
    err = Console(stderr=True)
    report = asyncio.run(run_bench(config, concurrency=counts, turns=lengths, repetitions=repetitions,
                                   say=lambda line: err.print(line, highlight=False)))  # fmt: skip
    report_and_exit(report, as_json=as_json, print_table=print_report)
