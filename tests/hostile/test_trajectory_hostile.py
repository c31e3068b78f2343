"""Hostile actions *inside a running trajectory*: each is a contained policy outcome --
the action's observation says what happened, the sandbox keeps its state, checkpoints
of the hostile state still dump and restore, and the trajectory completes.

Single actions against a bare sandbox are tested in tests/sandbox/test_sandbox.py; here
they run through the workflow (Temporal, scripted engine, real podman + CRIU), with a
checkpoint after every step, and a sandbox crash after the worst of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from belayer.client import follow_trajectories
from belayer.policy.config import PolicyConfig
from belayer.workflows.models import TrajectoryInput, TrajectoryProgress, TrajectoryResult
from belayer.workloads.models import ModelTask, TraceTask, TraceTurn

HOSTILE_TURNS = [
    # state the later turns must still see
    "mkdir -p /workspace/h && cd /workspace/h && export KEEP=kept && echo base > base.txt && echo ok",
    # gigabytes of output: capped in the observation, the turn goes on
    "head -c 1000000000 /dev/zero | tr '\\0' y; echo; echo tail-end",
    # binary and invalid UTF-8 on both streams
    "printf 'ok\\x00\\xff\\xfe\\x80end'; printf '\\xc3\\x28\\xa0\\xa1' >&2",
    # fill the disk
    "head -c 200M /dev/zero > /workspace/h/big; echo exit=$?; rm -f /workspace/h/big",
    # try the network
    "python3 -c \"import socket; s=socket.socket(); s.settimeout(3); s.connect(('1.1.1.1', 80))\"; echo exit=$?",
    # the supervisor's journal, channel, memory; signals to PID 1; host files
    "cat /var/lib/belayer/journal.jsonl; ls /run/belayer; cat /proc/1/environ; kill -9 1; kill -TERM 1; "
    "cat /proc/1/root/etc/shadow; ls /host /root/.local/state 2>&1 | head -3; echo survived",
    # a fork bomb that also hangs the turn: the pids limit contains it, the action timeout
    # freezes and kills every process the action started
    "bomb() { bomb | bomb; }; bomb",
    # after all that, the shell state is intact
    "cd /workspace/h && echo $KEEP $(pwd) && cat base.txt",
]
HOSTILE = TraceTask(
    id="hostile",
    turns=[TraceTurn(think_tokens=4, bash=command) for command in HOSTILE_TURNS],
    check='test "$(cat /workspace/h/base.txt)" = base',
)


async def start(stack, task, **kwargs):
    trajectory_id = f"{task.id}-{uuid.uuid4().hex[:8]}"
    return await stack.client.start_workflow(
        "TrajectoryWorkflow",
        TrajectoryInput(
            trajectory_id=trajectory_id,
            task=task,
            queues=stack.queues,
            **{"policy": PolicyConfig(mode="every-step"), **kwargs},
        ),
        id=trajectory_id,
        task_queue=stack.queues.context,
        result_type=TrajectoryResult,
    )


async def wait_for_step(handle, step: int) -> TrajectoryProgress:
    async with contextlib.aclosing(follow_trajectories(handle, every_s=0.05)) as following:
        async for progress in following:
            if progress.step >= step:
                return progress
    raise AssertionError(f"trajectory {handle.id} ended before step {step}")


async def test_hostile_actions_are_policy_outcomes_and_the_trajectory_completes(stack):
    handle = await start(stack, HOSTILE)
    result = await asyncio.wait_for(handle.result(), 900)
    steps = {s["step"]: s for s in await _steps(stack, handle.id)}
    assert result.status == "completed" and result.reward == 1.0, (result.reason, steps)
    assert result.turns == len(HOSTILE_TURNS)
    assert result.recoveries == []  # nothing here is an infrastructure failure
    assert result.checkpoints >= len(HOSTILE_TURNS) - 1  # hostile state checkpoints like any other
    assert steps[2]["exit_code"] == 0, steps[2]  # capped, not fatal
    assert steps[8]["exit_code"] == 0 and steps[8]["stdout"].startswith("kept /workspace/h"), steps[8]


async def test_sandbox_killed_after_hostile_actions_recovers(stack):
    """A crash after the fork bomb: the restored sandbox replays what it must, and whatever
    differs (the bomb's pids) is a consistent cut, never an infrastructure failure."""
    handle = await start(stack, HOSTILE)
    progress = await asyncio.wait_for(wait_for_step(handle, 7), 900)
    await asyncio.to_thread(stack.sandboxes.backend.podman, "kill", progress.sandbox.container)
    result = await asyncio.wait_for(handle.result(), 900)
    assert result.status == "completed" and result.reward == 1.0, result.reason
    assert result.recoveries, "the kill must have been noticed"
    for recovery in result.recoveries:
        assert recovery.consistent or recovery.cut_after_step is not None, recovery


async def test_huge_prompt_beyond_the_context_ends_the_trajectory_without_a_turn(stack):
    """An instruction longer than the whole context budget: no generation is attempted with
    a prompt the engine cannot take; the trajectory ends at once and says why."""
    task = ModelTask(id="huge-prompt", instruction="lorem ipsum dolor " * 20_000, max_turns=3)
    handle = await start(stack, task, max_total_tokens=2048)
    result = await asyncio.wait_for(handle.result(), 300)
    assert result.turns == 0 and result.tokens >= 2048
    assert result.status in ("failed_policy", "completed"), result
    assert result.status != "failed_infra"


async def _steps(stack, workflow_id: str):
    """The executed steps, from the history (what `belayer inspect` shows)."""
    from belayer.cli.run import _walk_history

    steps, _, _ = await _walk_history(
        stack.client.get_workflow_handle(workflow_id), stack.client.data_converter, stack.store
    )
    return steps


async def test_huge_prompt_is_a_policy_failure_that_says_why(stack):
    task = ModelTask(id="huge-prompt", instruction="lorem ipsum dolor " * 20_000, max_turns=3)
    handle = await start(stack, task, max_total_tokens=2048)
    result = await asyncio.wait_for(handle.result(), 300)
    assert result.status == "failed_policy" and "context" in result.reason, result


# An agent that cannot solve the task tries to forge the check and the plumbing instead.
FORGING_TURNS = [
    "grep() { return 0; }; test() { return 0; }; [() { return 0; }; eval() { return 0; }; "
    "printf() { return 0; }; read() { return 1; }; builtin() { exit 0; }; echo defined",
    "mkdir -p /workspace/bin && printf '#!/bin/sh\\nexit 0\\n' > /workspace/bin/grep && chmod +x /workspace/bin/grep"
    " && export PATH=/workspace/bin:$PATH && echo faked",
    "shopt -s expand_aliases; alias grep=true false=true; trap 'exit 0' EXIT ERR; trap 'true' DEBUG; "
    "shopt -s extdebug; set -e; echo aliased",
    "export BASH_ENV=/workspace/env.sh; echo 'exit 0' > /workspace/env.sh; echo ${__belayer_nonce:-no-nonce}",
    "echo later-out; echo later-err >&2; false",
]
FORGING = TraceTask(
    id="forging",
    turns=[TraceTurn(think_tokens=4, bash=command) for command in FORGING_TURNS],
    check="grep -q solved /workspace/answer.txt",
)


async def test_an_agent_cannot_forge_its_check_or_the_plumbing(stack):
    """Functions named like builtins, a fake grep first on PATH, aliases, traps, set -e,
    BASH_ENV: the check still runs in a clean process and fails; later actions still
    report their own exit status and output."""
    handle = await start(stack, FORGING)
    result = await asyncio.wait_for(handle.result(), 600)
    steps = {s["step"]: s for s in await _steps(stack, handle.id)}
    assert result.status == "failed_policy" and result.reward == 0.0, (result, steps)
    assert steps[4]["stdout"] == "no-nonce\n", steps[4]
    last = steps[len(FORGING_TURNS)]
    assert last["exit_code"] == 1 and last["stdout"] == "later-out\n" and last["stderr"] == "later-err\n", (
        last
    )
