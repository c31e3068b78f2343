"""`belayer sandboxes`: every live sandbox of the local stack, with the workflow it serves."""

from __future__ import annotations

import asyncio
import json

import click
from rich.console import Console
from rich.table import Table

from belayer.cli.context import config_from, console, leave
from belayer.errors import BelayerError
from belayer.stack.local import LocalStack
from belayer.stack.sandboxes import SandboxListing, list_sandboxes
from belayer.temporal_client import connect


@click.command()
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print {"sandboxes": [...], "staging": [...], "hosts_down": [...]} as JSON.',
)
@click.pass_context
def sandboxes(ctx: click.Context, as_json: bool) -> None:
    """List every sandbox on every sandbox host of the local stack: its id, host,
    trajectory (the workflow it serves; open it in the Temporal UI), that workflow's
    status, age, memory and disk; and each host's staging disk (checkpoints waiting for
    upload, archives being restored from) against sandbox.staging_budget_mb.

    A sandbox whose workflow is no longer RUNNING is removed by its host's reaper within
    sandbox.reap_interval_s; one listed without a trajectory was started outside any
    workflow (a program using the library) and is left to whoever started it.
    """
    config = config_from(ctx)
    stack = LocalStack(config)
    listing = asyncio.run(_listing(config, stack.sandbox_hosts))
    if as_json:
        click.echo(json.dumps({"sandboxes": [s.as_dict() for s in listing.sandboxes],
                               "staging": [h.as_dict() for h in listing.staging],
                               "hosts_down": listing.hosts_down}, indent=2))  # fmt: skip
        leave(0)
    _show(listing)
    leave(0)


async def _listing(config, hosts: int) -> SandboxListing:
    try:
        client = await connect(config.temporal, config.storage.encryption_key)
    except BelayerError as exc:
        console.print(f"[yellow]warning:[/] no workflow status: {exc}", highlight=False)
        client = None
    return await list_sandboxes(config, hosts, client)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _show(listing: SandboxListing) -> None:
    table = Table("sandbox", "host", "trajectory", "workflow", "state", "age s", "memory MiB", "disk MiB")
    for s in listing.sandboxes:
        table.add_row(s.sandbox_id, s.host, s.trajectory or "-", s.workflow_status or "-", s.state,
                      f"{s.age_s:.0f}", _mib(s.memory_bytes), _mib(s.disk_bytes))  # fmt: skip
    out = Console() if Console().is_terminal else Console(width=200)
    out.print(table)
    for h in listing.staging:
        console.print(f"host {h.host}: staging {_mib(h.staged_bytes)} MiB staged, {_mib(h.importing_bytes)} MiB "
                      f"being restored, {_mib(h.cached_bytes)} MiB of fork archives cached, of {_mib(h.budget_bytes)} "
                      "MiB (sandbox.staging_budget_mb)", highlight=False)  # fmt: skip
    for host in listing.hosts_down:
        console.print(f"[yellow]warning:[/] sandbox host {host} is not running: its sandboxes are not listed")
    console.print(f"{len(listing.sandboxes)} sandboxes", highlight=False)
