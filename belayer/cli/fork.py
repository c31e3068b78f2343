"""`belayer fork`: branch a finished trajectory after its step K into N new ones."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import click
from rich.console import Console

from belayer.branching import branch_inputs
from belayer.cli.context import config_from
from belayer.cli.run import _report, _Runner
from belayer.temporal_client import connect

console = Console(stderr=True)


@click.command()
@click.argument("trajectory")
@click.option(
    "--at-step",
    "at_step",
    required=True,
    type=click.IntRange(1),
    help="The last step of TRAJECTORY the branches keep.",
)
@click.option(
    "-n", "count", default=1, show_default=True, type=click.IntRange(1, 256), help="Branches to start."
)
@click.option(
    "--seed",
    type=click.IntRange(0),
    default=None,
    help="Sampling seed of the first branch, the next ones count up from it "
    "[default: the parent's seed + 1; the parent's own seed replays its later steps].",
)
@click.option(
    "--temperature",
    type=click.FloatRange(0, 5),
    default=None,
    help="Sampling temperature [default: the parent's].",
)
@click.option(
    "--concurrency",
    default=8,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Branches running at once.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every branch.")
@click.pass_context
def fork(
    ctx: click.Context,
    trajectory: str,
    at_step: int,
    count: int,
    seed: int | None,
    temperature: float | None,
    concurrency: int,
    as_json: bool,
) -> None:
    """Start N trajectories (-n) that continue TRAJECTORY after its step K.

    Each branch's sandbox is restored from TRAJECTORY's latest checkpoint at or before
    K (kept when it ran with `belayer run --keep-checkpoints`; else steps 1..K are
    replayed in a fresh sandbox) and replay-verified up to K, as a sandbox of its own;
    its context is TRAJECTORY's after step K. Exit status 1 when any branch ended
    failed_infra.
    """

    config = config_from(ctx.find_root())

    async def prepare():
        client = await connect(config.temporal, config.storage.encryption_key)
        return await branch_inputs(
            client, config, trajectory, at_step, count, seed=seed, temperature=temperature
        )

    inputs = asyncio.run(prepare())
    start = inputs[0].start_from
    if not as_json:
        restore = (
            f"the checkpoint at step {start.checkpoints[0].step} + replay to step {at_step}"
            if start.checkpoints
            else f"a replay of steps 1..{at_step} (no kept checkpoint)"
        )
        console.print(f"{count} branch(es) of {trajectory} after step {at_step}: sandboxes from {restore}")
    started_at = time.monotonic()
    results = asyncio.run(_Runner(config, inputs, concurrency).run(quiet=as_json))
    _report(results, time.monotonic() - started_at, as_json)
    sys.stdout.flush()
    # Exit without interpreter teardown: the Temporal SDK can abort at exit (docs/design.md §7).
    os._exit(1 if any(r.status == "failed_infra" for r in results) else 0)
