"""Draining a host on real sandboxes: each sandbox is checkpointed at its next safe point,
removed, and its next call told it moved; the recovery on another host starts from the
drain's checkpoint (nothing replayed, the state and the processes as they were); a
sandbox still busy at the deadline is killed and falls back; a draining host starts no
sandbox."""

from __future__ import annotations

import threading
import time

import pytest

from belayer.sandbox import drain
from belayer.sandbox.errors import HostDraining, SandboxNotFound
from belayer.sandbox.models import LoggedAction
from tests.sandbox.test_lineage_fencing import HOST_A, HOST_B, TRAJ, act, two_hosts  # noqa: F401 (fixture)

STEPS = [
    "echo first > /workspace/a && echo ok",
    "nohup sh -c 'while true; do date +%s%N >> /tmp/ticks; sleep 0.05; done' >/dev/null 2>&1 & echo started",
    "sleep 0.3; wc -l < /tmp/ticks | tr -d ' ' > /workspace/ticks; echo counted",
]


def run_steps(host, handle) -> list[LoggedAction]:
    log = []
    for step, command in enumerate(STEPS, start=1):
        obs = host.exec(handle, act(step, command))
        assert obs.exit_code == 0, obs
        log.append(LoggedAction(trajectory=TRAJ, step=step, command=command, observation_sha256=obs.sha256))
    return log


def test_a_drained_sandbox_resumes_on_another_host_from_the_drains_checkpoint(two_hosts):  # noqa: F811
    hosts = two_hosts
    handle = hosts.host_a.create(hosts.spec())
    log = run_steps(hosts.host_a, handle)
    periodic = hosts.host_a.checkpoint(handle)  # the workflow's own, at step 3 too: kept as the fallback

    report = drain.drain_host(hosts.host_a, deadline_s=0.5)

    (moved,) = report.sandboxes
    assert (moved.sandbox_id, moved.outcome, moved.step) == (handle.sandbox_id, "moved", len(STEPS)), (
        moved.detail
    )
    assert moved.paused_s > 0 and report.emptied_s is not None
    assert hosts.a.lineages() == {}  # removed from the drained host
    with pytest.raises(HostDraining):
        hosts.host_a.create(hosts.spec())
    # The trajectory's next call is answered at once: moved, not a time-out.
    with pytest.raises(SandboxNotFound, match="moved off host .* by a drain"):
        hosts.host_a.exec(handle, act(4, "true"))
    assert hosts.host_a.told_moved() == {handle.sandbox_id}

    outcome = hosts.host_b.recover(handle, [periodic], log)
    assert outcome.consistent and outcome.source == f"checkpoint@{len(STEPS)}" and outcome.replayed_steps == 0
    assert any("a drain took at step 3" in note for note in outcome.notes), outcome.notes
    # the workflow keeps the drain's checkpoint among its own: a second loss starts from it too
    assert outcome.drained_checkpoint is not None and outcome.drained_checkpoint.step == len(STEPS)
    assert outcome.drained_checkpoint != periodic
    new = outcome.handle
    assert (new.host_queue, new.generation) == (HOST_B, handle.generation + 1)
    # The background process came along: its ticks went on growing after the move.
    obs = hosts.host_b.exec(
        new,
        act(
            4,
            "sleep 0.3; cat /workspace/a; test $(wc -l < /tmp/ticks) -gt "
            "$(cat /workspace/ticks) && echo still-ticking",
        ),
    )
    assert obs.stdout == "first\nstill-ticking\n", obs
    hosts.host_b.destroy(new)  # before teardown: on one machine both hosts share the channel path


def test_a_sandbox_busy_past_the_deadline_is_killed_and_falls_back(two_hosts):  # noqa: F811
    hosts = two_hosts
    handle = hosts.host_a.create(hosts.spec())
    busy = threading.Thread(target=lambda: _ignore(lambda: hosts.host_a.exec(handle, act(1, "sleep 20"))))
    busy.start()
    time.sleep(1.0)  # the action is running: the sandbox has no safe point before the deadline

    report = drain.drain_host(hosts.host_a, deadline_s=1.0)
    busy.join(timeout=30)

    (fell,) = report.sandboxes
    assert fell.outcome == "fell-back" and "deadline" in fell.detail, fell
    assert hosts.a.lineages() == {}
    # No record: a recovery elsewhere starts from the workflow's checkpoints or replays.
    assert hosts.host_b.drained_checkpoint(handle) is None


def _ignore(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 -- the kill ends the action with an error
        pass
