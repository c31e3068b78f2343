"""`belayer drain HOST`: move every sandbox off a host before it goes away."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from belayer.cli.context import config_from, console, leave
from belayer.stack.drain import drain_host
from belayer.stack.local import LocalStack


@click.command()
@click.argument("host")
@click.option(
    "--deadline",
    "deadline_s",
    type=click.FloatRange(1, 3600),
    default=None,
    help="Seconds the host has left [default: sandbox.drain_deadline_s, 60].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the drain report as JSON.")
@click.pass_context
def drain(ctx: click.Context, host: str, deadline_s: float | None, as_json: bool) -> None:
    """Drain sandbox host HOST of the local stack, as before a spot preemption.

    HOST takes no new sandboxes; each of its sandboxes is checkpointed at its next safe
    point (no action running) and its trajectory resumes on another host from that
    checkpoint; what is still busy at the deadline is killed and recovers from its last
    checkpoint. The host's worker then exits (`belayer up` starts it again). HOST is a
    host name, service name or task queue as `belayer status` lists them. SIGTERM to a
    sandbox worker does the same, within sandbox.drain_deadline_s.
    """

    def show(report) -> None:
        counts = report.counts()
        console.print(f"  drain: {len(report.sandboxes)} sandboxes off the host ({counts['moved']} moved, "
                      f"{counts['fell-back']} fell back)", highlight=False)  # fmt: skip

    report = drain_host(LocalStack(config_from(ctx)), host, deadline_s, show)
    if as_json:
        click.echo(report.model_dump_json(indent=2))
        leave(0)
    table = Table("sandbox", "outcome", "step", "waited s", "paused s", "detail")
    for s in report.sandboxes:
        table.add_row(s.sandbox_id, s.outcome, "-" if s.step is None else str(s.step), f"{s.waited_s:.2f}",
                      f"{s.paused_s:.2f}", s.detail)  # fmt: skip
    out = Console() if Console().is_terminal else Console(width=200)
    out.print(table)
    counts = report.counts()
    console.print(f"drained {report.host_queue} in {report.emptied_s or 0:.2f}s: {counts['moved']} moved, "
                  f"{counts['fell-back']} fell back, {counts['gone']} already gone; {report.answered} of their "
                  f"trajectories told before the host left", highlight=False)  # fmt: skip
    leave(0)
