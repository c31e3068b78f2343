"""`belayer bench long-trajectory`: does a very long trajectory stay inside Temporal's limits?

Temporal refuses a payload over 2 MB and a history over 50 MB (it warns from 10 MB).
A trajectory keeps its histories bounded by continue-as-new, which only works if what
it carries from one run to the next is bounded too: steps, decisions and recoveries
live in the trajectory's log in the object store, observations travel as pointers. This
runs one trace trajectory of many turns on the running stack (`belayer up`),
`--repetitions` times one after another, and reports, over every run of each
trajectory's continue-as-new chain, the largest history, the largest single payload,
and how the carried state grows from the first run to the last. Those size figures are
the largest over the repetitions (they are checked against limits); the wall time
(`wall_s`, the median) and the seconds per turn come with their min / median / max
(`*_spread`); `trajectories` has each repetition's own figures.
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
from temporalio.api.common.v1 import Payload
from temporalio.api.history.v1 import History
from temporalio.client import WorkflowQueryFailedError
from temporalio.service import RPCError

from belayer.client import start_trajectory, trajectory_input, trajectory_progress
from belayer.measure import spread
from belayer.policy.config import PolicyConfig
from belayer.workloads.models import TraceTask, TraceTurn

TEMPORAL_PAYLOAD_LIMIT = 2 * 1024 * 1024
TEMPORAL_HISTORY_LIMIT = 50 * 1024 * 1024
# A trajectory's size figures (history_sizes) that the report gives as their largest.
SIZE_FIGURES = (
    "runs",
    "largest_history_bytes",
    "largest_payload_bytes",
    "first_input_bytes",
    "last_input_bytes",
)


async def history_sizes(client, workflow_id: str) -> dict:
    """Per run of the workflow's continue-as-new chain: events, history bytes, largest payload."""
    runs = []
    async for execution in client.list_workflows(f'WorkflowId = "{workflow_id}"'):
        handle = client.get_workflow_handle(workflow_id, run_id=execution.run_id)
        history = await handle.fetch_history()
        payloads = [len(p.SerializeToString()) for event in history.events for p in event_payloads(event)]
        carried = _carried_state_bytes(history)
        runs.append(
            {
                "run_id": execution.run_id,
                "started": execution.start_time.isoformat(),
                "events": len(history.events),
                "history_bytes": history_proto(history).ByteSize(),
                "largest_payload_bytes": max(payloads, default=0),
                "input_bytes": carried,
            }
        )
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

    return History(events=history.events)


def event_payloads(event):
    """Every payload an event carries (inputs, results, heartbeat details, failures' details)."""
    for _, value in event.ListFields():
        if hasattr(value, "ListFields"):
            yield from _walk(value)


def _walk(message):
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
    # The output comes from the sandbox, not from the command's text: the task (which every
    # run's input carries) stays small.
    output = f"; head -c {output_bytes} /dev/zero | tr '\\0' x; echo" if output_bytes else ""
    return TraceTask(
        id=f"long-{turns}",
        turns=[TraceTurn(think_tokens=2, bash=f"echo turn-{i}{output}") for i in range(1, turns + 1)],
        check="test -d /workspace",
    )


async def run_one(client, config, task, *, every: int, engine_queue: str, trajectory_id: str, say) -> dict:
    """One trace trajectory on the stack, its turns served from `engine_queue`; its outcome,
    wall time and history sizes."""

    input = trajectory_input(config, task)
    # A context budget that the trace cannot exhaust: this measures histories, not budgets.
    input = input.model_copy(
        update={
            "trajectory_id": trajectory_id,
            "continue_as_new_every": every,
            "max_total_tokens": 100_000_000,
            "policy": PolicyConfig(mode="adaptive"),
            "queues": input.queues.model_copy(update={"rollout": engine_queue}),
        }
    )
    started = time.monotonic()
    handle = await start_trajectory(client, config, input)
    waiter = asyncio.ensure_future(handle.result())
    while not waiter.done():
        await asyncio.wait({waiter}, timeout=30)
        progress = await _progress(client, trajectory_id)
        say(f"{time.monotonic() - started:7.0f}s  step {progress}/{len(task.turns)}")
    result = waiter.result()
    wall_s = time.monotonic() - started
    sizes = await history_sizes(client, trajectory_id)
    return {
        "trajectory_id": trajectory_id,
        "status": result.status,
        "reason": result.reason,
        "tokens": result.tokens,
        "wall_s": round(wall_s, 1),
        **{k: v for k, v in sizes.items() if k != "per_run"},
    }


def summarize(trajectories: list[dict], *, turns: int, every: int) -> dict:
    """The report over the repetitions: sizes at their largest (what the limits bound), the
    wall time as its median with min / median / max of it and of the seconds per turn, and
    one status when every repetition ended alike ("mixed" otherwise: see `trajectories`)."""
    statuses = {t["status"] for t in trajectories}
    walls = [t["wall_s"] for t in trajectories]
    return {
        "turns": turns,
        "continue_as_new_every": every,
        "repetitions": len(trajectories),
        "status": statuses.pop() if len(statuses) == 1 else "mixed",
        "reason": "; ".join(dict.fromkeys(t["reason"] for t in trajectories if t["reason"])),
        "tokens": max(t["tokens"] for t in trajectories),
        "wall_s": spread(walls, digits=1)["median"],
        "wall_s_spread": spread(walls, digits=1),
        "s_per_turn_spread": spread([w / turns for w in walls], digits=4),
        "payload_limit_bytes": TEMPORAL_PAYLOAD_LIMIT,
        "history_limit_bytes": TEMPORAL_HISTORY_LIMIT,
        **{k: max(t[k] for t in trajectories) for k in SIZE_FIGURES},
        "trajectories": trajectories,
    }


def print_report(report: dict) -> None:
    for key, value in report.items():
        if key == "trajectories":
            continue
        if key == "machine":
            value = f"{value['cores']} cores, load average {value['load_avg']} before, {value['after']} after"
        if key.endswith("_spread"):
            value = f"{value['min']} / {value['median']} / {value['max']} (min / median / max)"
        click.echo(f"{key:28} {value}")
    for t in report["trajectories"]:
        click.echo(
            f"  {t['trajectory_id']}: {t['status']} in {t['wall_s']} s, {t['runs']} runs, largest history "
            f"{t['largest_history_bytes']} bytes, largest payload {t['largest_payload_bytes']} bytes"
        )


async def _progress(client, trajectory_id: str) -> int | str:

    try:
        progress = await trajectory_progress(client.get_workflow_handle(trajectory_id))
    except (RPCError, WorkflowQueryFailedError) as exc:  # between two runs of the chain: keep waiting
        return f"? ({type(exc).__name__})"
    return progress.step
