"""Harbor tasks through the trajectory and group workflows on the real stack (Temporal,
SeaweedFS, podman + CRIU; scripted engine): the oracle and nop agents, graded rewards from
reward.json, a verifier that writes nothing or times out (the agent's failure, never a
retry), a sandbox lost after the oracle's action recovered to the same reward, and a group
of 4 forked from one set-up Harbor sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer.branching import branch_inputs
from belayer.cli.run import _walk_history
from belayer.client import trajectory_progress
from belayer.contracts.sandbox import VERIFY
from belayer.errors import BelayerError
from belayer.sandbox import runtime
from belayer.sandbox.images import ImageBuilder
from belayer.trajectory_log import read_steps
from belayer.workflows.models import TrajectoryResult
from belayer.workloads.harbor_tasks import STORAGE_NOTE, load_harbor_tasks
from tests.sandbox.conftest import own_layers
from tests.sandbox.test_harbor_check import write_task as write_two_step_task
from tests.workflows.test_groups import members, run_group
from tests.workflows.test_trajectory import start

DOCKERFILE = "FROM debian:bookworm\nWORKDIR /app\nRUN echo ready > /app/state\n"
TASKS = {
    # graded: two partial checks, the reward their mean
    "graded": (
        # a check allowed 15 minutes (past the sandbox activities' 10), a storage limit to note
        "storage_mb = 512\n[verifier]\ntimeout_sec = 900\n",
        'if [ -f /app/done ]; then echo \'{"a": 1, "b": 0.5}\'; else echo \'{"a": 0, "b": 0}\'; fi'
        " > /logs/verifier/reward.json",
    ),
    "silent": ("", "echo 'the tests forgot to write a reward'"),
    "slow": ("[verifier]\ntimeout_sec = 2\n", "sleep 30; echo 1 > /logs/verifier/reward.txt"),
    # the oracle's action cut at [agent].timeout_sec; the tests see [verifier].env
    "limited": (
        '[agent]\ntimeout_sec = 2\n[verifier]\nenv = { MODE = "strict" }\n',
        '[ "$MODE" = strict ] && [ -f /app/started ] && [ ! -f /app/done ] && r=1 || r=0; echo $r > /logs/verifier/reward.txt',
    ),
}
SOLUTIONS = {"limited": "touch /app/started; sleep 30; touch /app/done\n"}


def write_dataset(root: Path) -> Path:
    for name, (toml, test) in TASKS.items():
        task = root / name
        (task / "environment").mkdir(parents=True)
        (task / "tests").mkdir()
        (task / "solution").mkdir()
        (task / "task.toml").write_text('version = "1.0"\n[environment]\nallow_internet = false\n' + toml)
        (task / "instruction.md").write_text(f"Solve {name}.\n")
        (task / "environment" / "Dockerfile").write_text(own_layers(DOCKERFILE))
        (task / "tests" / "test.sh").write_text(f"#!/bin/bash\nmkdir -p /logs/verifier\n{test}\n")
        (task / "solution" / "solve.sh").write_text(
            "#!/bin/bash\n" + SOLUTIONS.get(name, "touch /app/done\necho solved\n")
        )
    return root


@pytest.fixture
def dataset(stack, tmp_path):
    builder = ImageBuilder({"debian:bookworm": runtime.base_image_name()})
    path = write_dataset(tmp_path / "dataset")

    def tasks(agent: str) -> dict:
        loaded = load_harbor_tasks(path, store=stack.sandboxes.host.store, builder=builder, agent=agent)
        return {task.id: task for task in loaded}

    yield tasks
    for tag in {task.image for task in tasks("nop").values()}:
        builder.podman("rmi", "-f", tag)


async def test_the_oracle_scores_graded_rewards_and_a_verifier_without_one_fails_the_agent(stack, dataset):
    tasks = dataset("oracle")
    graded = await (await start(stack, tasks["graded"])).result()
    assert (graded.status, graded.reward, graded.rewards) == ("completed", 0.75, {"a": 1.0, "b": 0.5}), graded
    assert graded.turns == 1 and graded.verifier_logs == {
        "reward.json": f"trajectories/{graded.trajectory_id}/verifier/step-2/reward.json"
    }
    # it asks for no network; its storage limit cannot be enforced here: what it used is noted
    assert graded.notes[:1] == [STORAGE_NOTE] and len(graded.notes) == 2, graded.notes
    assert (
        graded.notes[1].startswith("storage: ") and "(storage_mb 512 is not enforced here)" in graded.notes[1]
    )
    assert 0 < graded.disk_bytes < 10 << 20, graded.disk_bytes
    handle = stack.client.get_workflow_handle(graded.trajectory_id)
    limits = [event.activity_task_scheduled_event_attributes.start_to_close_timeout.ToSeconds()
              async for event in handle.fetch_history_events()
              if event.activity_task_scheduled_event_attributes.activity_type.name == VERIFY.name]  # fmt: skip
    assert limits == [900 + 120], "the activity outlasts the check's own limit"
    _, _, summary = await _walk_history(handle, stack.client.data_converter, stack.sandboxes.host.store)
    verifier = summary["verifier"]  # what `belayer inspect` shows
    assert verifier["exit_code"] == 0 and verifier["logs"] == {"reward.json": '{"a": 1, "b": 0.5}\n'}, (
        verifier
    )
    silent = await (await start(stack, tasks["silent"])).result()
    assert (silent.status, silent.reward) == ("failed_policy", 0.0)
    assert "wrote no reward" in silent.reason and silent.recoveries == [], silent.reason
    slow = await (await start(stack, tasks["slow"])).result()
    assert (slow.status, slow.reward) == ("failed_policy", 0.0)
    assert "timed out after 2 s" in slow.reason and slow.recoveries == [], slow.reason
    limited = await (await start(stack, tasks["limited"])).result()
    assert (limited.status, limited.reward) == ("completed", 1.0), limited


async def test_the_nop_agent_scores_zero_on_a_sound_task(stack, dataset):
    nop = await (await start(stack, dataset("nop")["graded"])).result()
    assert (nop.status, nop.reward, nop.turns) == ("completed", 0.0, 0), nop


async def test_a_sandbox_lost_after_the_oracles_action_recovers_to_the_same_reward(
    stack, dataset, monkeypatch
):
    task = dataset("oracle")["graded"]
    original, killed = stack.sandboxes.host.exec, []

    def exec_then_kill(handle, action, **kwargs):
        observation = original(handle, action, **kwargs)
        if action.step == 1 and not kwargs.get("isolated") and not killed:
            killed.append(handle.container)
            stack.sandboxes.host.kill(handle)
        return observation

    monkeypatch.setattr(stack.sandboxes.host, "exec", exec_then_kill)
    result = await (await start(stack, task)).result()
    assert killed and (result.status, result.reward) == ("completed", 0.75), result
    (recovery,) = result.recoveries
    assert recovery.consistent, recovery


async def test_a_group_of_four_forks_from_one_set_up_harbor_sandbox(stack, dataset):
    group = await run_group(stack, members(stack, dataset("oracle")["graded"], 4))
    assert (group.group.forked, group.group.fallback) == (4, ""), group.group
    assert [(r.status, r.reward) for r in group.results] == [("completed", 0.75)] * 4


@pytest.fixture
def two_step(stack, tmp_path):
    builder = ImageBuilder({"debian:bookworm": runtime.base_image_name()})
    path = write_two_step_task(tmp_path)

    def task(agent: str):
        (loaded,) = load_harbor_tasks(path, store=stack.sandboxes.host.store, builder=builder, agent=agent)
        return loaded

    yield task
    builder.podman("rmi", "-f", task("nop").image)


async def test_a_multi_step_task_runs_its_steps_in_one_sandbox_and_recovers_within_a_step(
    stack, two_step, monkeypatch
):
    original, killed = stack.sandboxes.host.exec, []

    def exec_then_kill(handle, action, **kwargs):
        observation = original(handle, action, **kwargs)
        if action.command.startswith("bash /solution") and action.step > 1 and not killed:
            killed.append(action.step)  # the second step's oracle action: after the boundary
            stack.sandboxes.host.kill(handle)
        return observation

    monkeypatch.setattr(stack.sandboxes.host, "exec", exec_then_kill)
    oracle = await (await start(stack, two_step("oracle"))).result()
    assert (oracle.status, oracle.reward, oracle.turns) == ("completed", 1.0, 2), oracle
    assert oracle.rewards == {"reward": 1.0, "half": 0.5, "step1": 1.0, "step2": 1.0}
    # the second step's artifacts, read back after its check
    store = stack.sandboxes.host.store
    assert {path: store.get_bytes(key) for path, key in oracle.artifacts.items()} == {
        "app/two": b"two\n",
        "app/given.txt": b"given\n",
    }
    (recovery,) = oracle.recoveries
    assert killed == [3] and recovery.source == "checkpoint@2" and recovery.replayed_steps == 1, recovery


async def test_a_branch_inside_a_later_step_continues_that_step(
    stack, two_step, stack_config, storage_config
):
    """`belayer fork --at-step K` with K in a multi-step task's second step: the branch
    starts from the boundary's checkpoint, keeps the first step's check as the parent had
    it and runs only the second step; without a checkpoint past the boundary it is refused
    (a replay cannot cross the tests), while the first step still branches by replay."""
    config = stack_config.model_copy(update={"storage": storage_config})
    # no checkpoint but the boundary's (awaited whatever the policy): step 3 replays from it
    handle = await start(stack, two_step("oracle"), "none", keep_checkpoints=True)
    parent = await handle.result()
    lineage = (await trajectory_progress(handle)).sandbox.sandbox_id
    try:
        assert (parent.status, parent.turns) == ("completed", 2), parent
        assert [(s.step, s.stage) for s in read_steps(stack.store, parent.log.steps)] == [
            (1, 0),
            (2, 1),
            (3, 1),
        ]
        for k in (2, 3):  # the boundary itself, and the second step's action
            (branch,) = await branch_inputs(stack.client, config, parent.trajectory_id, k, 1)
            assert (branch.start_from.stage_start, len(branch.start_from.stage_checks)) == (2, 1)
            result = await stack.client.execute_workflow(
                "TrajectoryWorkflow", branch.model_copy(update={"keep_checkpoints": False}),
                id=branch.trajectory_id, task_queue=stack.queues.context, result_type=TrajectoryResult,
            )  # fmt: skip
            assert (result.status, result.reward, result.rewards) == ("completed", 1.0, parent.rewards), (
                result
            )
            (forked,) = result.recoveries
            assert (forked.kind, forked.source, forked.replayed_steps) == ("fork", "checkpoint@2", k - 2), (
                forked
            )
            assert [(s.step, s.stage) for s in read_steps(stack.store, result.log.steps)] == [
                (1, 0),
                (2, 1),
                (3, 1),
            ]
    finally:
        stack.sandboxes.host.delete_checkpoints(lineage)

    unkept = await (await start(stack, two_step("oracle"))).result()
    with pytest.raises(BelayerError, match="began at step 2.*--keep-checkpoints"):
        await branch_inputs(stack.client, config, unkept.trajectory_id, 3, 1)
    (first_step,) = await branch_inputs(stack.client, config, unkept.trajectory_id, 1, 1)
    assert (first_step.start_from.stage_checks, first_step.start_from.checkpoints) == ([], [])


async def test_a_step_below_its_min_reward_stops_the_task_there(stack, two_step):
    nop = await (await start(stack, two_step("nop"))).result()
    assert (nop.status, nop.reward, nop.turns) == ("completed", 0.0, 0), nop
    assert nop.rewards == {"reward": 0.0, "step1": 0.0} and "stopped early" in nop.reason, nop


# The oracle leaves a process ticking; the tests pass only when it ticks while they run.
TICKING_SOLUTION = (
    "#!/bin/bash\nnohup bash -c 'while true; do date +%s%N > /app/tick; sleep 0.1; done' >/dev/null 2>&1 &\n"
)
TICKING_TEST = (
    "#!/bin/bash\nmkdir -p /logs/verifier\nfirst=$(cat /app/tick); sleep 1\n"
    '[ "$first" != "$(cat /app/tick)" ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'
)


async def test_the_agents_processes_run_through_its_tests_unless_frozen(stack, tmp_path):
    """Harbor's semantics by default (a server the agent left must answer the tests); with
    freezing asked for (`--freeze-agent`, or `freeze_agent: true` on a workload's `harbor:`
    entry) nothing of the agent's runs while it is judged."""
    task = tmp_path / "ticking"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "task.toml").write_text('version = "1.0"\n[environment]\nallow_internet = false\n')
    (task / "instruction.md").write_text("Keep it ticking.\n")
    (task / "environment" / "Dockerfile").write_text(own_layers(DOCKERFILE))
    (task / "tests" / "test.sh").write_text(TICKING_TEST)
    (task / "solution" / "solve.sh").write_text(TICKING_SOLUTION)
    builder = ImageBuilder({"debian:bookworm": runtime.base_image_name()})
    store = stack.sandboxes.host.store
    (running,) = load_harbor_tasks(task, store=store, builder=builder, agent="oracle")
    (frozen,) = load_harbor_tasks(task, store=store, builder=builder, agent="oracle", freeze_agent=True)
    try:
        kept = await (await start(stack, running)).result()
        stopped = await (await start(stack, frozen)).result()
    finally:
        builder.podman("rmi", "-f", running.image)
    assert (kept.status, kept.reward) == ("completed", 1.0), kept
    assert (stopped.status, stopped.reward) == ("completed", 0.0), stopped
