"""Groups forked from one set-up sandbox, and branches from a trajectory's step K, on the
real stack (Temporal, SeaweedFS, podman + CRIU), scripted engine."""

from __future__ import annotations

import uuid

from belayer.client import trajectory_progress
from belayer.policy.config import PolicyConfig
from belayer.sandbox.checkpoints import checkpoints_at_or_before
from belayer.trajectory_log import read_steps
from belayer.workflows.groups import GroupInput, GroupResult
from belayer.workflows.models import ForkStart, TrajectoryInput, TrajectoryResult
from belayer.workloads.models import TraceTask, TraceTurn
from tests.workflows.test_trajectory import start

SET_UP = TraceTask(
    id="set-up",
    setup=[
        "mkdir -p /workspace/app && cd /workspace/app && seq 1 500 > data.txt && git init -q . 2>/dev/null; true",
        "nohup python3 -m http.server 8767 --bind 127.0.0.1 --directory /workspace/app >/dev/null 2>&1 &"
        " for i in $(seq 100); do python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8767/')\""
        " 2>/dev/null && break; sleep 0.1; done",
    ],
    turns=[
        TraceTurn(think_tokens=8, bash="cd /workspace/app && wc -l data.txt"),
        TraceTurn(
            think_tokens=8,
            bash='python3 -c "import urllib.request as u; '
            "print(len(u.urlopen('http://127.0.0.1:8767/data.txt').read()))\"",
        ),
        TraceTurn(think_tokens=8, bash="echo more >> data.txt && tail -1 data.txt"),
        TraceTurn(think_tokens=8, bash="sha256sum data.txt | cut -c1-16"),
    ],
    check='test "$(tail -1 /workspace/app/data.txt)" = more',
)


def members(stack, task, n: int, policy: str = "every-step") -> list[TrajectoryInput]:
    token = uuid.uuid4().hex[:6]
    return [TrajectoryInput(trajectory_id=f"{task.id}-{token}-m{i}", task=task, queues=stack.queues,
                            policy=PolicyConfig(mode=policy)) for i in range(n)]  # fmt: skip


async def run_group(stack, inputs, **kwargs) -> GroupResult:
    group_id = f"group-{inputs[0].trajectory_id}"
    return await stack.client.execute_workflow(
        "TrajectoryGroupWorkflow", GroupInput(group_id=group_id, members=inputs, workflow_queue=stack.queues.context,
                                              **kwargs),
        id=group_id, task_queue=stack.queues.context, result_type=GroupResult,
    )  # fmt: skip


def origin_objects(stack, record) -> list[str]:
    prefix = record.origin.meta_key.rsplit("/", 2)[0] + "/"
    return [k for k in stack.store.list(prefix) if "/lineage/" not in k]


async def test_a_group_forks_its_members_from_one_set_up_sandbox(stack):
    lone = await (await start(stack, SET_UP)).result()
    assert lone.status == "completed", lone.reason
    group = await run_group(stack, members(stack, SET_UP, 3))
    record = group.group
    assert (record.forked, record.fallback, record.notes) == (3, "", []), record
    assert record.setup_s > 0 and record.fork_s > 0 and record.ready_s >= record.fork_s
    for result in group.results:
        assert result.status == "completed" and result.recoveries == [], result.reason
        # forks of one sandbox behave exactly as a sandbox set up alone: same tokens, same files
        assert (result.token_sha256, result.env_sha256) == (lone.token_sha256, lone.env_sha256)
    handles = [await trajectory_progress(stack.client.get_workflow_handle(r.trajectory_id))
               for r in group.results]  # fmt: skip
    assert len({p.sandbox.sandbox_id for p in handles}) == 3
    assert all(p.sandbox.sandbox_id != record.setup_sandbox.sandbox_id for p in handles)
    assert origin_objects(stack, record) == []  # released with the group


async def test_a_member_that_loses_its_sandbox_recovers_alone_from_the_origin(stack, monkeypatch):
    inputs = members(stack, SET_UP, 2, policy="none")  # no checkpoints of its own: only the origin
    victim = inputs[0].trajectory_id
    original = stack.sandboxes.host.exec
    killed = []

    def exec_then_kill(handle, action, **kwargs):
        obs = original(handle, action, **kwargs)
        if action.trajectory == victim and action.step == 2 and not killed:
            killed.append(handle.container)
            stack.sandboxes.host.kill(handle)
        return obs

    monkeypatch.setattr(stack.sandboxes.host, "exec", exec_then_kill)
    group = await run_group(stack, inputs)
    first, second = group.results
    assert killed and first.status == "completed" and second.status == "completed"
    [recovery] = first.recoveries
    assert recovery.source == "checkpoint@0" and recovery.consistent and recovery.replayed_steps == 2, (
        recovery
    )
    assert second.recoveries == [] and first.env_sha256 == second.env_sha256


async def test_a_damaged_origin_makes_the_members_create_their_own(stack, monkeypatch):
    monkeypatch.setenv("BELAYER_FAULT", "sandbox_restore_damaged_archive")
    group = await run_group(stack, members(stack, SET_UP, 2))
    # The archive is cut after its checks: each fork fails on it, and each member says why.
    assert group.group.forked == 0 and "no fork started" in group.group.fallback, group.group
    assert sum("creates its own sandbox" in note for note in group.group.notes) == 2, group.group.notes
    assert [r.status for r in group.results] == ["completed", "completed"]
    assert origin_objects(stack, group.group) == []


async def test_a_branch_from_step_k_replays_the_parents_later_steps(stack):
    parent = await (await start(stack, SET_UP, keep_checkpoints=True)).result()
    assert parent.status == "completed", parent.reason
    progress = await trajectory_progress(stack.client.get_workflow_handle(parent.trajectory_id))
    steps = read_steps(stack.store, parent.log.steps)
    k = 2
    refs = checkpoints_at_or_before(stack.sandboxes.host.store, "sandboxes/", progress.sandbox.sandbox_id, k)
    assert [r.step for r in refs] == [2, 1, 0] or [r.step for r in refs][:2] == [2, 1], refs
    branch_id = f"{parent.trajectory_id}-b"
    start_from = ForkStart(
        parent=parent.trajectory_id, at_step=steps[k - 1], steps=parent.log.steps, checkpoints=refs
    )
    branch = await stack.client.execute_workflow(
        "TrajectoryWorkflow",
        TrajectoryInput(trajectory_id=branch_id, task=SET_UP, queues=stack.queues,
                        policy=PolicyConfig(mode="every-step"), start_from=start_from),
        id=branch_id, task_queue=stack.queues.context, result_type=TrajectoryResult,
    )  # fmt: skip
    assert branch.status == "completed", branch.reason
    assert (branch.token_sha256, branch.env_sha256, branch.turns) == (parent.token_sha256, parent.env_sha256,
                                                                      parent.turns)  # fmt: skip
    [start_record] = branch.recoveries
    assert (start_record.kind, start_record.source, start_record.replayed_steps) == (
        "fork",
        f"checkpoint@{k}",
        0,
    )
    branch_steps = read_steps(stack.store, branch.log.steps)
    assert [s.command for s in branch_steps] == [s.command for s in steps]
    # the parent's sandbox lineage is untouched: the branch is a lineage of its own
    after = await trajectory_progress(stack.client.get_workflow_handle(branch_id))
    assert after.sandbox.sandbox_id != progress.sandbox.sandbox_id
    stack.sandboxes.host.delete_checkpoints(progress.sandbox.sandbox_id)
