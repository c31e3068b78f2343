"""`belayer bench long-trajectory`: does a very long trajectory stay inside Temporal's limits?

Temporal refuses a payload over 2 MB and a history over 50 MB (it warns from 10 MB).
A trajectory keeps its histories bounded by continue-as-new, which only works if what
it carries from one run to the next is bounded too: steps, decisions and recoveries
live in the trajectory's log in the object store, observations travel as pointers. This
runs one trace trajectory of many turns on the running stack (`belayer up`) and
reports, over every run of its continue-as-new chain, the largest history, the largest
single payload, and how the carried state grows from the first run to the last.
Simulated: the engine. The turns are a trace (each action prints a line, a few "think"
tokens a turn), served by `belayer.testing.ScriptedRollout` on a queue of the bench's
own: thousands of turns outgrow any small model's context, and what is measured --
histories and payloads -- does not depend on who drew the tokens. The sandbox host, the
workflow worker, Temporal and the object store are the running stack's.
"""

from __future__ import annotations

import asyncio
import time

import click

from belayer.bench.output import report_and_exit

TEMPORAL_PAYLOAD_LIMIT = 2 * 1024 * 1024
TEMPORAL_HISTORY_LIMIT = 50 * 1024 * 1024


async def history_sizes(client, workflow_id: str) -> dict:
    """Per run of the workflow's continue-as-new chain: events, history bytes, largest payload."""
    runs = []
    async for execution in client.list_workflows(f'WorkflowId = "{workflow_id}"'):
        handle = client.get_workflow_handle(workflow_id, run_id=execution.run_id)
        history = await handle.fetch_history()
        payloads = [len(p.SerializeToString()) for event in history.events for p in _payloads(event)]
        carried = _carried_state_bytes(history)
        runs.append({"run_id": execution.run_id, "started": execution.start_time.isoformat(),
                     "events": len(history.events), "history_bytes": history_proto(history).ByteSize(),
                     "largest_payload_bytes": max(payloads, default=0), "input_bytes": carried})
    runs.sort(key=lambda r: r["started"])
    return {
        "runs": len(runs),
        "largest_history_bytes": max((r["history_bytes"] for r in runs), default=0),
        "largest_payload_bytes": max((r["largest_payload_bytes"] for r in runs), default=0),
        "first_input_bytes": runs[0]["input_bytes"] if runs else 0,
        "last_input_bytes": runs[-1]["input_bytes"] if runs else 0,
        "per_run": runs,
    }


def history_proto(history):
    """The run's history as Temporal stores it (what its 50 MB limit counts)."""
    from temporalio.api.history.v1 import History

    return History(events=history.events)


def _payloads(event):
    """Every payload an event carries (inputs, results, heartbeat details, failures' details)."""
    for _, value in event.ListFields():
        if hasattr(value, "ListFields"):
            yield from _walk(value)


def _walk(message):
    from temporalio.api.common.v1 import Payload

    if isinstance(message, Payload):
        yield message
        return
    for _, value in message.ListFields():
        if hasattr(value, "ListFields"):
            yield from _walk(value)
        elif isinstance(value, (list, tuple)) or type(value).__name__.startswith("Repeated"):
            for item in value:
                if hasattr(item, "ListFields"):
                    yield from _walk(item)


def _carried_state_bytes(history) -> int:
    """Size of the run's input: the first run's is the task; later ones carry the state."""
    first = history.events[0].workflow_execution_started_event_attributes
    return sum(len(p.SerializeToString()) for p in first.input.payloads)


def long_trace(turns: int, output_bytes: int):
    from belayer.workloads.models import TraceTask, TraceTurn

    # The output comes from the sandbox, not from the command's text: the task (which every
    # run's input carries) stays small.
    output = f"; head -c {output_bytes} /dev/zero | tr '\\0' x; echo" if output_bytes else ""
    return TraceTask(
        id=f"long-{turns}",
        turns=[TraceTurn(think_tokens=2, bash=f"echo turn-{i}{output}") for i in range(1, turns + 1)],
        check="test -d /workspace",
    )


@click.command("long-trajectory")
@click.option("--turns", default=2000, show_default=True, type=click.IntRange(1, 100_000),
              help="Turns of the trace trajectory.")
@click.option("--continue-as-new-every", "every", default=100, show_default=True, type=click.IntRange(1),
              help="Steps per workflow run.")
@click.option("--output-bytes", default=200, show_default=True, type=click.IntRange(0, 65536),
              help="Bytes each action prints (observations are stored, never in payloads).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.pass_context
def long_trajectory(ctx: click.Context, turns: int, every: int, output_bytes: int, as_json: bool) -> None:
    """Run one trace trajectory of many turns and report its histories against Temporal's limits."""
    from rich.console import Console

    from belayer.cli.main import config_from
    from belayer.client import start_trajectory, trajectory_input
    from belayer.policy.config import PolicyConfig
    from belayer.temporal_client import connect

    config = config_from(ctx.find_root())
    err = Console(stderr=True)

    async def main() -> dict:
        from temporalio.worker import Worker

        from belayer.model.build import model_path
        from belayer.storage.store import ObjectStore
        from belayer.testing import ScriptedRollout

        client = await connect(config.temporal, config.storage.encryption_key)
        task = long_trace(turns, output_bytes)
        trajectory_id = f"long-{turns}-{int(time.time())}"
        engine_queue = f"belayer-bench-scripted-{trajectory_id}"
        tokenizer = model_path(config.rollout.model, config.cache_dir) / "tokenizer.json"
        engine = ScriptedRollout(ObjectStore(config.storage), tokenizer, node_queue=engine_queue)
        input = trajectory_input(config, task)
        # A context budget that the trace cannot exhaust: this measures histories, not budgets.
        input = input.model_copy(update={
            "trajectory_id": trajectory_id, "continue_as_new_every": every, "max_total_tokens": 100_000_000,
            "policy": PolicyConfig(mode="adaptive"),
            "queues": input.queues.model_copy(update={"rollout": engine_queue}),
        })
        started = time.monotonic()
        async with Worker(client, task_queue=engine_queue, activities=[engine.generate]):
            handle = await start_trajectory(client, config, input)
            waiter = asyncio.ensure_future(handle.result())
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=30)
                progress = await _progress(client, trajectory_id)
                err.print(f"{time.monotonic() - started:7.0f}s  step {progress}/{turns}", highlight=False)
            result = waiter.result()
        sizes = await history_sizes(client, trajectory_id)
        return {"trajectory_id": trajectory_id, "turns": turns, "continue_as_new_every": every,
                "status": result.status, "reason": result.reason, "tokens": result.tokens,
                "wall_s": round(time.monotonic() - started, 1),
                "payload_limit_bytes": TEMPORAL_PAYLOAD_LIMIT, "history_limit_bytes": TEMPORAL_HISTORY_LIMIT,
                **{k: v for k, v in sizes.items() if k != "per_run"}}

    report_and_exit(asyncio.run(main()), as_json=as_json, print_table=_print)


def _print(report: dict) -> None:
    for key, value in report.items():
        click.echo(f"{key:28} {value}")


async def _progress(client, trajectory_id: str) -> int | str:
    from temporalio.client import WorkflowQueryFailedError
    from temporalio.service import RPCError

    from belayer.workflows.models import TrajectoryProgress

    try:
        progress = await client.get_workflow_handle(trajectory_id).query("progress", result_type=TrajectoryProgress)
    except (RPCError, WorkflowQueryFailedError) as exc:  # between two runs of the chain: keep waiting
        return f"? ({type(exc).__name__})"
    return progress.step
