"""`belayer serve`: the OpenAI-compatible endpoint over agent sessions (belayer/serve/)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from belayer.cli.context import config_from, console, leave
from belayer.errors import BelayerError


@click.command()
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    type=click.Path(path_type=Path, exists=True),
    help="A workload file or Harbor task directory whose tasks sessions may run (repeatable).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=8400, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on."
)
@click.pass_context
def serve(ctx: click.Context, workloads: tuple[Path, ...], host: str, port: int) -> None:
    """Serve /v1/chat/completions and /v1/completions for agents that own their loop.

    Each agent starts a session of a task (POST /v1/sessions {"task": ID}), sends the
    session's id in the X-Session-ID header of every model call, runs its commands with
    POST /v1/sessions/ID/exec and ends with POST /v1/sessions/ID/finish, which runs the
    task's check. A session is a durable trajectory on the running stack (`belayer up`):
    its sandbox is checkpointed and restored, its engine failures recovered inside the
    call, its calls recorded in its token log; open it in the Temporal UI by its id.
    Example: examples/openai_agent.py.
    """
    import uvicorn  # import cost: the HTTP server and FastAPI, paid only by `belayer serve`

    from belayer.serve.app import create_app  # import cost: FastAPI, as above
    from belayer.serve.sessions import Sessions, load_tasks  # import cost: the workflow models, as above

    config = config_from(ctx)
    try:
        tasks = load_tasks(config, list(workloads))
        sessions = asyncio.run(Sessions.connect(config))
    except BelayerError as exc:
        console.print(f"[red]error:[/] {exc}", highlight=False)
        leave(1)
    console.print(
        f"belayer serve: http://{host}:{port}/v1 ({len(tasks)} task(s): {', '.join(sorted(tasks)) or 'none'})",
        highlight=False,
    )
    try:
        uvicorn.run(create_app(sessions, tasks), host=host, port=port, log_level="warning")
    finally:
        sessions.close()
    leave(0)
