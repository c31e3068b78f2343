"""TrajectoryWorkflow on the real stack (Temporal, SeaweedFS, podman + CRIU), scripted engine."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import uuid

import pytest

from belayer.client import follow_trajectories, trajectory_progress
from belayer.policy.config import PolicyConfig
from belayer.trajectory_log import read_decisions
from belayer.workflows.models import TrajectoryInput, TrajectoryProgress, TrajectoryResult
from belayer.workloads.models import TraceTask, TraceTurn

STATEFUL_TRACE = TraceTask(
    id="stateful",
    setup=["mkdir -p /workspace/w"],
    turns=[
        TraceTurn(think_tokens=8, bash="cd /workspace/w && export MARK=kept && pwd"),
        TraceTurn(think_tokens=8, bash="seq 1 200 > numbers.txt && wc -l numbers.txt"),
        TraceTurn(
            think_tokens=8,
            bash="nohup python3 -m http.server 8766 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1; echo up",
        ),
        TraceTurn(think_tokens=8, bash="echo $MARK $(pwd) && sha256sum numbers.txt | cut -c1-16"),
        TraceTurn(
            think_tokens=8,
            bash="python3 -c \"import urllib.request as u; print(len(u.urlopen('http://127.0.0.1:8766/numbers.txt').read()))\"",
        ),
        TraceTurn(think_tokens=8, bash="echo done >> numbers.txt && tail -1 numbers.txt"),
    ],
    check='test "$(tail -1 /workspace/w/numbers.txt)" = done',
)


async def start(stack, task, policy: str | PolicyConfig = "every-step", **kwargs):
    """Start a trajectory; `policy` is a mode, or a whole policy configuration."""
    trajectory_id = f"{task.id}-{uuid.uuid4().hex[:8]}"
    return await stack.client.start_workflow(
        "TrajectoryWorkflow",
        TrajectoryInput(
            trajectory_id=trajectory_id,
            task=task,
            queues=stack.queues,
            policy=policy if isinstance(policy, PolicyConfig) else PolicyConfig(mode=policy),
            **kwargs,
        ),
        id=trajectory_id,
        task_queue=stack.queues.context,
        result_type=TrajectoryResult,
    )


async def wait_for_progress(handle, done, what: str, tries: int = 600) -> TrajectoryProgress:
    """Follow `progress` until `done(progress)`, at most `tries` snapshots and at the latest
    when the trajectory ends (its final snapshot included); fail saying `what` never happened."""
    snapshots = 0
    async with contextlib.aclosing(follow_trajectories(handle, every_s=0.05)) as following:
        async for progress in following:
            if done(progress):
                return progress
            snapshots += 1
            if snapshots == tries:
                break
        else:
            if done(final := await trajectory_progress(handle)):
                return final
    raise AssertionError(f"trajectory never {what}")


async def wait_for_step(handle, step: int) -> TrajectoryProgress:
    return await wait_for_progress(handle, lambda p: p.step >= step, f"reached step {step}")


async def test_trace_completes_and_repeats_identically(stack):
    first = await (await start(stack, STATEFUL_TRACE)).result()
    second = await (await start(stack, STATEFUL_TRACE)).result()
    assert first.status == "completed", first.reason
    assert first.reward == 1.0 and first.turns == len(STATEFUL_TRACE.turns)
    assert first.checkpoints >= len(STATEFUL_TRACE.turns) - 1
    assert (first.token_sha256, first.env_sha256) == (second.token_sha256, second.env_sha256)
    assert first.recoveries == []
    # The web UI's filters: trajectories by task and status (search attributes).
    found = []
    for _ in range(50):
        found = [
            w.id
            async for w in stack.client.list_workflows(
                'BelayerTask = "stateful" AND BelayerStatus = "completed"'
            )
        ]
        if first.trajectory_id in found:
            break
        await asyncio.sleep(0.1)
    assert first.trajectory_id in found and second.trajectory_id in found


async def test_sandbox_killed_mid_trajectory_recovers_identically(stack):
    reference = await (await start(stack, STATEFUL_TRACE)).result()
    handle = await start(stack, STATEFUL_TRACE)
    progress = await wait_for_step(handle, 4)
    stack.sandboxes.backend.podman("kill", progress.sandbox.container, check=False)
    result = await handle.result()
    assert result.status == "completed", result.reason
    assert len(result.recoveries) >= 1
    recovery = result.recoveries[0]
    assert recovery.consistent and recovery.source.startswith("checkpoint@")
    assert (result.token_sha256, result.env_sha256) == (reference.token_sha256, reference.env_sha256)


async def activity_events(handle) -> list[tuple[str, str]]:
    """(scheduled | completed, activity name) in the order of the workflow's history."""
    names: dict[int, str] = {}
    events = []
    for event in (await handle.fetch_history()).events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            names[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
            events.append(("scheduled", names[event.event_id]))
        elif event.HasField("activity_task_completed_event_attributes"):
            events.append(
                ("completed", names[event.activity_task_completed_event_attributes.scheduled_event_id])
            )
    return events


async def test_each_action_waits_for_the_checkpoints_capture_and_runs_beside_its_publish(stack):
    """A checkpoint's capture runs beside the next generation and the action waits for it;
    its publish (compression, upload) is scheduled only with that action, and the action is
    scheduled before the publish is over: the upload is never waited for."""
    handle = await start(stack, STATEFUL_TRACE)
    result = await handle.result()
    assert result.status == "completed", result.reason
    events = await activity_events(handle)
    assert ("scheduled", "sandbox.checkpoint") not in events
    captures = [i for i, e in enumerate(events) if e == ("scheduled", "sandbox.capture_checkpoint")]
    assert len(captures) == result.checkpoints >= len(STATEFUL_TRACE.turns) - 1
    for start_at in captures[:-1]:  # the last follows the last action: nothing generates beside it
        later = events[start_at:]
        captured = start_at + later.index(("completed", "sandbox.capture_checkpoint"))
        action = start_at + later.index(("scheduled", "sandbox.exec"))
        publish = start_at + later.index(("scheduled", "sandbox.publish_checkpoint"))
        published = start_at + later.index(("completed", "sandbox.publish_checkpoint"))
        assert ("completed", "generate") in events[start_at:action], "no generation beside the capture"
        assert captured < action < published, events[start_at : published + 1]
        assert publish > action, "the publish started beside the generation, before the action"


async def test_the_last_observation_is_appended_by_the_node_beside_the_final_check(stack):
    """After the last action, the final check and the last observation's append are
    scheduled together, the append on the node that served the turns; a node that does not
    have the append (an older version) leaves it to the workflow's worker, with the same
    context and the same verdict."""
    on_node = await start(stack, STATEFUL_TRACE, policy="none")
    by_node = await on_node.result()
    assert by_node.status == "completed", by_node.reason
    events = await activity_events(on_node)
    append = events.index(("scheduled", "append_observation"))
    assert events[append - 1] == ("scheduled", "sandbox.exec"), events[append - 3 :]  # the check, just before
    assert events.index(("completed", "append_observation")) > append
    history = await on_node.fetch_history()
    queues = [
        e.activity_task_scheduled_event_attributes.task_queue.name
        for e in history.events
        if e.activity_task_scheduled_event_attributes.activity_type.name == "append_observation"
    ]
    assert queues == [stack.queues.rollout]

    await stack.replace_rollout_worker([stack.rollout.generate])
    fallback = await start(stack, STATEFUL_TRACE, policy="none")
    locally = await fallback.result()
    assert locally.status == "completed", locally.reason
    events = await activity_events(fallback)
    assert events.count(("scheduled", "append_observation")) == 1  # refused once, not retried
    assert ("completed", "append_observation") not in events
    assert (locally.token_sha256, locally.env_sha256, locally.tokens) == (
        by_node.token_sha256,
        by_node.env_sha256,
        by_node.tokens,
    )


CLOCK_TRACE = STATEFUL_TRACE.model_copy(
    update={
        "id": "clock",
        "turns": [
            TraceTurn(think_tokens=8, bash="mkdir -p /workspace/w && cd /workspace/w"),
            TraceTurn(think_tokens=8, bash="date +%s%N | tee /workspace/w/stamp"),
            TraceTurn(think_tokens=8, bash="sleep 0.5; echo three"),
            TraceTurn(think_tokens=8, bash="sleep 0.5; echo four"),
            TraceTurn(think_tokens=8, bash="sleep 0.5; echo five"),
        ],
        "check": "test -s /workspace/w/stamp",
    }
)


async def test_nondeterministic_action_after_restore_cuts_the_context(stack):
    task = CLOCK_TRACE
    # No checkpoints: the restore replays from the start, so `date` runs again and differs.
    handle = await start(stack, task, policy="none")
    progress = await wait_for_step(handle, 4)
    stack.sandboxes.backend.podman("kill", progress.sandbox.container, check=False)
    result = await handle.result()
    assert result.status == "completed", result.reason
    cut = [r for r in result.recoveries if r.cut_after_step is not None]
    assert cut and cut[0].cut_after_step == 2 and not cut[0].consistent
    assert cut[0].tokens_discarded > 0
    assert result.turns == len(task.turns)


async def test_long_trajectory_continues_as_new(stack):
    """History restarts every few steps; state (sandbox, context, policy) carries over."""
    reference = await (await start(stack, STATEFUL_TRACE)).result()
    handle = await start(stack, STATEFUL_TRACE, continue_as_new_every=2)
    result = await handle.result()
    assert result.status == "completed", result.reason
    assert (result.token_sha256, result.env_sha256) == (reference.token_sha256, reference.env_sha256)
    runs = 0
    async for _execution in stack.client.list_workflows(f'WorkflowId = "{handle.id}"'):
        runs += 1
    assert runs >= 3


VARIED_TRACE = TraceTask(
    id="varied",
    turns=[
        TraceTurn(think_tokens=tokens, bash=f"echo {i}")
        for i, tokens in enumerate((8, 64, 8, 8, 64), start=1)
    ],
    check="true",
)


async def test_policy_blind_to_the_trace_lengths_predicts_from_history(stack):
    """Told a trace's lengths, each decision predicts the coming turn's generation from
    them (none after the last turn); blind to them, as on a model task, it predicts the
    mean of the recent generations. The scripted engine reports its per-token latency and
    no queueing, so both predictions are exact."""
    tokens = [turn.think_tokens for turn in VARIED_TRACE.turns]
    per_token_s = stack.rollout.per_token_s

    async def predictions(trace_lengths_known: bool) -> list[float]:
        policy = PolicyConfig(mode="adaptive", trace_lengths_known=trace_lengths_known)
        result = await (await start(stack, VARIED_TRACE, policy=policy)).result()
        assert result.status == "completed", result.reason
        decisions = await asyncio.to_thread(read_decisions, stack.store, result.log)
        assert [d.step for d in decisions] == list(range(1, len(tokens) + 1))
        return [d.predicted_generation_s for d in decisions]

    told = [*tokens[1:], 0]
    assert await predictions(True) == pytest.approx([n * per_token_s for n in told], abs=1e-6)
    history = PolicyConfig().history
    recent_means = [statistics.mean(tokens[:step][-history:]) for step in range(1, len(tokens) + 1)]
    assert await predictions(False) == pytest.approx([n * per_token_s for n in recent_means], abs=1e-6)


async def test_record_history_for_replay(stack, monkeypatch):
    """Refreshes tests/workflows/histories/ when BELAYER_RECORD_HISTORIES=1; else skipped.

    Together the histories cover the workflow's paths: checkpoints every step and a
    restore; adaptive decisions, a context cut and continue-as-new (every run of it); a
    recovery that fails and ends the trajectory as failed_infra.
    """
    import os
    from pathlib import Path

    from belayer import faults

    if os.environ.get("BELAYER_RECORD_HISTORIES") != "1":
        pytest.skip("set BELAYER_RECORD_HISTORIES=1 to re-record the checked-in histories")
    out = Path(__file__).parent / "histories"
    out.mkdir(exist_ok=True)

    async def save(handle, name: str) -> None:
        found = [
            (w.start_time, w.run_id) async for w in stack.client.list_workflows(f'WorkflowId = "{handle.id}"')
        ]
        runs = [run_id for _, run_id in sorted(found)]
        for i, run_id in enumerate(runs, start=1):
            history = await stack.client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
            suffix = f"-run{i}" if len(runs) > 1 else ""
            (out / f"{name}{suffix}.json").write_text(history.to_json())

    handle = await start(stack, STATEFUL_TRACE)
    progress = await wait_for_step(handle, 4)
    stack.sandboxes.backend.podman("kill", progress.sandbox.container, check=False)
    assert (await handle.result()).status == "completed"
    await save(handle, "stateful-with-sandbox-recovery")

    handle = await start(stack, CLOCK_TRACE, policy="adaptive", continue_as_new_every=2)
    progress = await wait_for_step(handle, 4)
    stack.sandboxes.backend.podman("kill", progress.sandbox.container, check=False)
    result = await handle.result()
    assert result.status == "completed" and any(r.cut_after_step for r in result.recoveries), result
    await save(handle, "adaptive-cut-continue-as-new")

    handle = await start(stack, STATEFUL_TRACE, policy="none", max_recoveries=1)
    await wait_for_step(handle, 3)
    monkeypatch.setenv(faults.ENV, "sandbox_kill_during_exec")
    result = await handle.result()
    assert result.status == "failed_infra" and result.recoveries[-1].failed, result
    await save(handle, "failed-recovery")
