"""`belayer chaos FAULT`: inject one real fault into the running local stack;
`belayer chaos soak`: the chaos soak (the same command as `belayer bench chaos`)."""

from __future__ import annotations

import asyncio
import json

import click

from belayer.chaos.faults import TRAINING_FAULT_KINDS, Chaos, ChaosError
from belayer.cli.bench.chaos import chaos as soak
from belayer.cli.context import config_from
from belayer.client import trajectory_progress
from belayer.temporal_client import connect


class FaultOrCommand(click.Group):
    """A group whose first argument may also be a fault kind: `belayer chaos FAULT ...`
    stays `belayer chaos inject FAULT ...`, as it was before the group had commands."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["inject", *args]
        return super().resolve_command(ctx, args)


@click.group(cls=FaultOrCommand)
def chaos() -> None:
    """Real faults against the running local stack.

    `belayer chaos FAULT` (or `belayer chaos inject FAULT`) injects one now; `belayer chaos
    soak` runs the seeded soak over every fault kind (`belayer bench chaos`). Use `belayer
    run --chaos PLAN` for faults at chosen steps, `belayer train --chaos PLAN` at chosen
    iterations.
    """


@chaos.command()
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
def inject(
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


chaos.add_command(soak, "soak")
