"""A long trajectory keeps Temporal's side small: what it carries across continue-as-new
does not grow with its steps, and no observation text enters any payload -- the steps,
decisions and observations are in the trajectory's log in the object store."""

from __future__ import annotations

import asyncio
import uuid

from belayer.bench.history import history_proto, history_sizes
from belayer.policy.config import PolicyConfig
from belayer.sandbox.observations import load_observation
from belayer.trajectory_log import read_decisions, read_steps
from belayer.workflows.models import TrajectoryInput, TrajectoryResult
from belayer.workloads.models import TraceTask, TraceTurn

TURNS, EVERY = 24, 4


async def test_long_trajectory_carries_a_bounded_state_and_no_observation_text(stack):
    marker = f"obs-marker-{uuid.uuid4().hex[:12]}"
    head, tail = marker[:6], marker[6:]  # the command holds the halves; only the output joins them
    task = TraceTask(
        id="bounded",
        turns=[
            TraceTurn(
                think_tokens=2,
                bash=f"printf '%s%s-%s\\n' {head} {tail} {i}; head -c 4000 /dev/zero | tr '\\0' y",
            )
            for i in range(1, TURNS + 1)
        ],
        check="test -d /workspace",
    )
    trajectory_id = f"bounded-{uuid.uuid4().hex[:8]}"
    handle = await stack.client.start_workflow(
        "TrajectoryWorkflow",
        TrajectoryInput(
            trajectory_id=trajectory_id,
            task=task,
            queues=stack.queues,
            continue_as_new_every=EVERY,
            policy=PolicyConfig(mode="none"),
            max_total_tokens=2_000_000,
        ),
        id=trajectory_id,
        task_queue=stack.queues.context,
        result_type=TrajectoryResult,
    )
    result = await asyncio.wait_for(handle.result(), 900)
    assert result.status == "completed", result

    sizes = await history_sizes(stack.client, trajectory_id)
    assert sizes["runs"] == TURNS // EVERY
    carried = [run["input_bytes"] for run in sizes["per_run"][1:]]
    # Counters and pointers grow by a few digits; a step record per step would add ~1 KB a run.
    assert max(carried) - min(carried) < 256, carried
    for run in sizes["per_run"]:
        history = await stack.client.get_workflow_handle(trajectory_id, run_id=run["run_id"]).fetch_history()
        assert marker.encode() not in history_proto(history).SerializeToString()

    steps = await asyncio.to_thread(read_steps, stack.store, result.log.steps)
    assert [s.step for s in steps] == list(range(1, TURNS + 1))
    last = await asyncio.to_thread(load_observation, stack.store, steps[-1].observation)
    assert (
        last.stdout.startswith(f"{marker}-{TURNS}\n")
        and last.stdout_bytes == len(f"{marker}-{TURNS}\n") + 4000
    )
    decisions = await asyncio.to_thread(read_decisions, stack.store, result.log)
    assert [d.step for d in decisions] == list(range(1, TURNS + 1))
    assert all(d.actual_generation_s is not None for d in decisions[:-1])  # written once complete
