"""`belayer bench serve`: its options and output; the benchmark itself is `belayer.bench.serve`."""

from __future__ import annotations

import asyncio

import click
from rich.console import Console

from belayer.bench.serve import print_report, run_bench
from belayer.cli.bench.output import report_and_exit
from belayer.cli.context import config_from


@click.command("serve")
@click.option("--sessions", "sessions_count", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Conversations per side.")  # fmt: skip
@click.option(
    "--calls",
    default=12,
    show_default=True,
    type=click.IntRange(1, 200),
    help="Model calls per conversation.",
)
@click.option(
    "--max-tokens", default=32, show_default=True, type=click.IntRange(1, 1024), help="Tokens per call."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.pass_context
def serve(ctx: click.Context, sessions_count: int, calls: int, max_tokens: int, as_json: bool) -> None:
    """A model call through `belayer serve` against vLLM's own OpenAI server.

    Needs the running stack (`belayer up`); starts vLLM's server on the rollout node's model
    with the node engines' settings, and serves Belayer's endpoint from this process. The
    calls alternate between the two, one at a time; figures are min / median / max over
    sessions x calls calls each.
    """
    config = config_from(ctx.find_root())
    err = Console(stderr=True)
    report = asyncio.run(run_bench(config, sessions_count=sessions_count, calls=calls, max_tokens=max_tokens,
                                   say=lambda m: err.print(m, highlight=False)))  # fmt: skip
    report_and_exit(report, as_json=as_json, print_table=print_report)
