"""`belayer chaos FAULT`: inject one real fault into the running local stack."""

from __future__ import annotations

import asyncio
import json

import click

from belayer.chaos.faults import TRAINING_FAULT_KINDS, Chaos, ChaosError
from belayer.cli.context import config_from
from belayer.client import trajectory_progress
from belayer.temporal_client import connect


@click.command()
@click.argument("fault", type=click.Choice(TRAINING_FAULT_KINDS))
@click.option(
    "--trajectory",
    default=None,
    help="For sandbox-crash and sandbox-host-crash: the trajectory whose sandbox (and its host) dies.",
)
@click.option(
    "--duration",
    default=5.0,
    show_default=True,
    type=click.FloatRange(0, 3600),
    help="For s3-outage: seconds the object store stays down.",
)
@click.option(
    "--node",
    default=None,
    metavar="ID",
    help="For engine-crash, engine-hang, owner-crash and node-crash: the rollout node id "
    "(default: the stack's first node).",
)
@click.option(
    "--host",
    default=None,
    metavar="NAME",
    help="For sandbox-host-crash: the sandbox host, as `belayer status` names it (default: the "
    "host of --trajectory's sandbox, else the machine's own).",
)
@click.pass_context
def chaos(
    ctx: click.Context,
    fault: str,
    trajectory: str | None,
    duration: float,
    node: str | None,
    host: str | None,
) -> None:
    """Inject FAULT now: processes are SIGKILLed, servers stopped, containers killed.

    Supervised workers that a kill takes down are restarted afterwards, as a cluster
    supervisor would. Use `belayer run --chaos PLAN` to inject faults at chosen steps, and
    `belayer train --chaos PLAN` at chosen iterations.
    """
    config = config_from(ctx.find_root())
    container = None
    if fault == "sandbox-crash" and not trajectory:
        raise ChaosError("sandbox-crash needs --trajectory ID (whose sandbox to kill)")
    if fault in ("sandbox-crash", "sandbox-host-crash") and trajectory:
        container = asyncio.run(_sandbox_of(config, trajectory))
    report = Chaos(config).inject(
        fault, sandbox_container=container, duration_s=duration, node=node, host=host
    )
    click.echo(json.dumps(report.model_dump()))


async def _sandbox_of(config, trajectory: str) -> str:

    client = await connect(config.temporal, config.storage.encryption_key)
    progress = await trajectory_progress(client.get_workflow_handle(trajectory))
    if progress.sandbox is None:
        raise ChaosError(f"trajectory {trajectory} has no sandbox yet")
    return progress.sandbox.container
