"""The `belayer` command line: a thin layer over the library; no logic of its own."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import click
import tomli_w
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from belayer.cli.bench import bench
from belayer.cli.chaos import chaos
from belayer.cli.context import config_from, console, leave
from belayer.cli.drain import drain
from belayer.cli.fork import fork
from belayer.cli.model import model
from belayer.cli.report import report
from belayer.cli.run import inspect, run
from belayer.cli.sandboxes import sandboxes
from belayer.cli.serve import serve
from belayer.cli.tasks import tasks
from belayer.cli.train import train
from belayer.codec_server import make_server
from belayer.config import masked_dump
from belayer.errors import BelayerError, StackError
from belayer.prepare import add_missing_search_attributes, create_bucket_if_missing
from belayer.stack.local import LocalStack, root_warning, status_as_dicts


class BelayerGroup(click.Group):
    """Turns every BelayerError into one clear line and exit status 1, no traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BelayerError as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            leave(1)


@click.group(cls=BelayerGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    default=None,
    help="TOML config file (default: $BELAYER_CONFIG or ~/.config/belayer/config.toml).",
)
@click.pass_context
def main(ctx: click.Context, config_file: Path | None) -> None:
    """Belayer keeps LLM agentic RL rollouts alive through engine and sandbox failures.

    Start the local stack with `belayer up`, check it with `belayer status`.
    """
    ctx.obj = {"config_file": config_file}


@main.command()
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until every component answers.")
@click.option(
    "--only",
    default=None,
    metavar="NAME,...",
    help="Start only these components (temporal, codec-server, seaweedfs, sandbox-worker, "
    "rollout-node, trajectory-worker, trainer-worker; codec-server only with "
    "temporal.encrypt_payloads; rollout-node.K and sandbox-worker.K for the nodes and "
    "hosts after the first).",
)
@click.option(
    "--sandbox-hosts",
    type=click.IntRange(1, 16),
    default=None,
    help="Sandbox hosts to run (default: as many as the running stack has, else "
    "stack.sandbox_hosts, 1): this machine, then hosts with their own name, storage and "
    "namespaces (<machine>-h1, ...).",
)
@click.option(
    "--rollout-nodes",
    type=click.IntRange(1, 16),
    default=None,
    help="Rollout nodes to run (default: as many as the running stack has, else "
    "stack.rollout_nodes, 1); their ids are rollout.node_id, then <node_id>.1, ...",
)
@click.pass_context
def up(
    ctx: click.Context, wait: bool, only: str | None, sandbox_hosts: int | None, rollout_nodes: int | None
) -> None:
    """Start the local stack in the background: Temporal dev server and web UI, SeaweedFS,
    and Belayer's workers (sandbox host, rollout nodes, trajectory worker, trainer)."""

    config = config_from(ctx)
    stack = LocalStack(config, rollout_nodes=rollout_nodes, sandbox_hosts=sandbox_hosts)
    stack.select(only.split(",") if only else None)
    warning = root_warning()
    if warning:
        console.print(f"[yellow]warning:[/] {warning}")
    with console.status("starting the local stack") as spinner:

        def report(message: str) -> None:
            spinner.update(message)
            console.print(f"  {message}", highlight=False)

        stack.up(report, wait=wait)
    console.print(
        f"[green]up[/]: state in {config.state_dir}; "
        f"Temporal UI http://{config.temporal.address.rpartition(':')[0]}:{config.temporal.ui_port}"
    )
    leave(0)


@main.command()
@click.pass_context
def down(ctx: click.Context) -> None:
    """Stop exactly what `belayer up` started."""

    LocalStack(config_from(ctx)).down(lambda m: console.print(f"  {m}", highlight=False))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show each component: pid, address, health. Exit 1 when any is unhealthy."""

    rows = LocalStack(config_from(ctx)).status()
    if as_json:
        click.echo(
            json.dumps(
                {"components": status_as_dicts(rows), "healthy": all(r.healthy for r in rows)}, indent=2
            )
        )
    else:
        table = Table("component", "pid", "address", "health", "detail")
        for row in rows:
            health = "[green]healthy[/]" if row.healthy else "[red]unhealthy[/]"
            table.add_row(row.name, str(row.pid or "-"), row.address, health, row.detail)
        out = Console()
        if not out.is_terminal:
            out = Console(width=200)
        out.print(table)
    leave(0 if all(r.healthy for r in rows) else 1)


@main.command()
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0, 3600),
    default=120.0,
    show_default=True,
    help="Seconds to keep retrying while Temporal or the object store does not answer yet.",
)
@click.pass_context
def prepare(ctx: click.Context, wait_s: float) -> None:
    """Make an existing Temporal and object store ready for Belayer (idempotent).

    Registers the search attributes the workflows set and creates the bucket when it is
    missing. `belayer up` does this for the local stack; a deployment with its own
    Temporal cluster and S3 runs it once per deploy (infra/deploy runs it as a job).
    """

    config = config_from(ctx)
    steps = [
        (
            f"Temporal at {config.temporal.address} (namespace {config.temporal.namespace})",
            lambda: asyncio.run(add_missing_search_attributes(config.temporal)),
            lambda added: (
                f"search attributes added: {', '.join(added)}" if added else "search attributes present"
            ),
        ),
        (
            f"bucket {config.storage.bucket} at {config.storage.endpoint}",
            lambda: create_bucket_if_missing(config.storage),
            lambda created: "created" if created else "present",
        ),
    ]
    deadline = time.monotonic() + wait_s
    for what, step, said in steps:
        while True:
            try:
                console.print(f"  {what}: {said(step())}", highlight=False, soft_wrap=True)
                break
            except Exception as exc:  # not up yet, refused, or denied: retried, then named
                if time.monotonic() >= deadline:
                    raise StackError(
                        f"{what} did not answer within {wait_s:.0f} s: {exc}; check the address and "
                        "credentials (BELAYER_TEMPORAL__*, BELAYER_STORAGE__*) or raise --wait"
                    ) from None
                time.sleep(2)
    console.print("[green]prepared[/]", highlight=False)
    leave(0)


@main.command("codec-server")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port on 127.0.0.1 (default: temporal.codec_port, 8081).",
)
@click.pass_context
def codec_server(ctx: click.Context, port: int | None) -> None:
    """Decode encrypted Temporal payloads for the web UI (Temporal's remote codec protocol).

    Serves POST /encode and /decode on 127.0.0.1 with storage.encryption_key; point the UI at
    it with `temporal server start-dev --ui-codec-endpoint http://127.0.0.1:8081` (what
    `belayer up` does when temporal.encrypt_payloads is on). Stops on Ctrl-C or SIGTERM.
    """

    config = config_from(ctx)
    server = make_server(config, port)
    # SystemExit unwinds serve_forever in this thread; server.shutdown() would wait on itself.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    console.print(
        f"codec server on {server.endpoint} (key id {server.codec.key_id}, "
        f"namespace {config.temporal.namespace}); web UI origins: "
        f"{', '.join(sorted(server.origins))}",
        highlight=False,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@main.group()
def config() -> None:
    """Inspect the effective configuration."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of TOML.")
@click.pass_context
def config_show(ctx: click.Context, as_json: bool) -> None:
    """Print the effective configuration, secrets masked."""

    data = masked_dump(config_from(ctx.find_root()))
    click.echo(json.dumps(data, indent=2) if as_json else tomli_w.dumps(data))


for command in (run, inspect, fork, drain, train, chaos, report, bench, model, tasks, sandboxes, serve):
    main.add_command(command)
