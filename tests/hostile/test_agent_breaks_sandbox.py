"""An agent that breaks its own sandbox fails as the policy, never as infrastructure.

Losing the sandbox used to be recovered whatever lost it, and a loss that kept coming
back ended the trajectory `failed_infra`: a dropped group, never a zero. So an agent
about to fail its check could trade the zero for a dropped group by bringing its own
sandbox down. Now the host says why each sandbox was lost (SandboxHost.exec,
belayer.sandbox.host.loss_cause) and the workflow ends a loss the agent caused as
`failed_policy` with reward 0, while a sandbox killed from outside is recovered as before.

The agent's weapon here is the OOM killer. PID 1 ignores every signal the agent can send
it, its oom_score_adj (0) is not the agent's to write, and the agent's processes start
with oom_score_adj 1000, but the agent can still lower its own to 0 (the floor it
inherited) and fill the memory limit with processes each smaller than PID 1: with every
score equal, the OOM killer then picks PID 1, every time the action runs. Real stack: Temporal, SeaweedFS, podman + CRIU, scripted engine.
"""

from __future__ import annotations

import asyncio

import pytest

from belayer.activities.runtime import to_application_error
from belayer.cli.run import _print_inspection, _walk_history
from belayer.sandbox.backend import ContainerExit
from belayer.sandbox.errors import SandboxUnreachable
from belayer.sandbox.host import loss_cause
from belayer.workloads.models import TraceTask, TraceTurn
from tests.hostile.test_trajectory_hostile import start, wait_for_step

RESULT_TIMEOUT_S = 600


@pytest.fixture(autouse=True)
def _oom_marker_out_of_the_checkout(tmp_path, monkeypatch):
    """conmon writes an empty file `oom` into the working directory of whoever started a
    container that saw an OOM kill (podman's own record of it goes elsewhere): these tests
    start theirs from a temporary directory, not the checkout."""
    monkeypatch.chdir(tmp_path)


# Each process holds ~13 MB (Python and 4 MiB of its own), less than PID 1's ~20 MB: with
# every score at 0, the OOM killer takes the largest process, PID 1.
BRING_PID1_DOWN = (
    "echo 0 > /proc/self/oom_score_adj; "
    "for i in $(seq 100); do python3 -c 'import time; b = b\"x\" * (4 << 20); time.sleep(300)' & done; wait"
)


async def inspection(stack, workflow_id: str) -> dict:
    """What `belayer inspect` reports of a trajectory (its steps, checkpoints and result)."""
    handle = stack.client.get_workflow_handle(workflow_id)
    steps, checkpoints, summary = await _walk_history(handle, stack.client.data_converter, stack.store)
    return {
        "id": workflow_id,
        "status": "COMPLETED",
        "ui": "-",
        "steps": steps,
        "checkpoints": checkpoints,
        **summary,
    }


def trace(task_id: str, *commands: str) -> TraceTask:
    """A scripted trajectory whose check passes unless something ends it first: a reward of 0
    can only come from the way it ended."""
    return TraceTask(id=task_id, turns=[TraceTurn(think_tokens=4, bash=c) for c in commands],
                     check="test -f /workspace/started")  # fmt: skip


BREAKS_AT_STEP_2 = trace(
    "oom-pid1", "touch /workspace/started && echo started", BRING_PID1_DOWN, "echo unreachable"
)


async def test_an_action_that_oom_kills_pid1_fails_the_policy_with_its_step(stack, capsys):
    handle = await start(stack, BREAKS_AT_STEP_2, max_recoveries=2)
    result = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
    assert result.status == "failed_policy" and result.reward == 0.0, (result.status, result.reason)
    assert "step 2" in result.reason and "OOM" in result.reason, result.reason
    assert result.sandbox_broken is not None, result
    assert (result.sandbox_broken.step, result.sandbox_broken.cause) == (2, "oom"), result.sandbox_broken
    assert result.recoveries == [], "a sandbox the agent broke is not recovered"
    assert result.turns == 2
    _print_inspection(await inspection(stack, handle.id))
    assert "the agent broke its sandbox at step 2 (oom)" in capsys.readouterr().out


async def test_a_loss_without_a_visible_cause_that_the_action_repeats_after_a_restore_fails_the_policy(
    stack, monkeypatch
):
    """A host that cannot see the container's OOM count (no memory cgroup to read; podman's
    own OOMKilled is not set on this machine kind either): the first loss has no cause
    found and is recovered; the same action loses the restored sandbox again, which makes
    it the agent's."""
    monkeypatch.setattr(stack.sandboxes.backend, "memory_cgroup", lambda container: None)
    handle = await start(stack, BREAKS_AT_STEP_2, max_recoveries=4)
    result = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
    assert result.status == "failed_policy" and result.reward == 0.0, (result.status, result.reason)
    broken = result.sandbox_broken
    assert broken is not None and (broken.step, broken.cause) == (2, "reproduced"), result
    assert "step 2" in result.reason and "again after a restore" in result.reason, result.reason
    assert len(result.recoveries) == 1 and not result.recoveries[0].failed, result.recoveries


async def test_a_kill_from_outside_after_the_agent_oom_killed_its_own_process_is_recovered(stack):
    """The agent's own process was OOM-killed (a contained outcome: PID 1 lives, the count of
    OOM kills in the cgroup is 1), then the container is killed from outside as a chaos
    sandbox-crash does (`podman kill`): that loss is infrastructure, recovered, and the
    trajectory completes."""
    task = trace("oom-then-kill",
                 "touch /workspace/started; python3 -c 'b = b\"x\" * (900 << 20)'; echo own-process-exit=$?",
                 "sleep 8; echo slept", "echo after")  # fmt: skip
    handle = await start(stack, task)
    progress = await asyncio.wait_for(wait_for_step(handle, 2), RESULT_TIMEOUT_S)
    await asyncio.to_thread(stack.sandboxes.backend.podman, "kill", progress.sandbox.container)
    result = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
    assert result.status == "completed" and result.reward == 1.0, (result.status, result.reason)
    assert result.sandbox_broken is None
    assert result.recoveries and not result.recoveries[0].failed, result.recoveries
    assert "from outside" in result.recoveries[0].reason, result.recoveries[0].reason


@pytest.mark.parametrize(
    ("ended", "oom_kills", "cause"),
    [
        (ContainerExit(found=False), None, "outside"),  # removed: a fence, a drain, a destroy
        (
            ContainerExit(found=True, exit_code=137, stopped_from_outside=("kill",)),
            3,
            "outside",
        ),  # an OOM before
        (
            ContainerExit(found=True, exit_code=137, oom_killed=True, stopped_from_outside=("stop",)),
            None,
            "outside",
        ),
        (ContainerExit(found=True, exit_code=137), 1, "oom"),
        (ContainerExit(found=True, exit_code=137, oom_killed=True), None, "oom"),
        (ContainerExit(found=True, exit_code=137), None, "unexplained"),  # a SIGKILL nobody owns
        (ContainerExit(found=True, exit_code=143), 0, "unexplained"),
        (ContainerExit(found=True, running=True), 1, "unexplained"),  # alive, not answering
        (ContainerExit(found=True, exit_code=1), None, "pid1-exited"),
        (ContainerExit(found=True, exit_code=0), 0, "pid1-exited"),
    ],
)
def test_loss_cause_blames_the_agent_only_for_what_nothing_outside_did(ended, oom_kills, cause):
    assert loss_cause(ended, oom_kills)[0] == cause


def test_the_hosts_finding_crosses_to_the_workflow_with_the_error():
    error = to_application_error(SandboxUnreachable("lost", cause="oom", step=4))
    assert error.type == "SandboxUnreachable" and error.non_retryable
    assert error.details == ({"cause": "oom", "step": 4},)
    assert to_application_error(SandboxUnreachable("no answer")).details == ()
