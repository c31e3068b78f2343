"""A container frozen mid-checkpoint when its host "loses power" (`sandbox_hosts.end`)."""

from __future__ import annotations

import psutil

from belayer.sandbox import freezer
from belayer.stack import sandbox_hosts


def container_processes(sandboxes, container: str) -> tuple[list[psutil.Process], tuple]:
    pid = int(sandboxes.backend.podman("inspect", "--format", "{{.State.Pid}}", container).stdout)
    control = freezer.freezer_control(pid)
    assert control is not None, f"no freezer for pid {pid}"
    pids = (control[0].parent / "cgroup.procs").read_text().split()
    return [psutil.Process(int(p)) for p in pids], control


def test_killing_the_processes_of_a_container_frozen_by_a_dump_ends_them(sandboxes):
    """CRIU freezes the container's cgroup for a dump; killed with the rest of its host, it
    never thaws it. The container's processes must still die, not linger frozen under init."""
    handle = sandboxes.create("sleep 300 &")  # the supervisor, the agent's shell and a child
    procs, (state, frozen, _) = container_processes(sandboxes, handle.container)
    assert len(procs) >= 2, procs
    state.write_text("FROZEN" if "FROZEN" in frozen else "1")  # what the dump's start does
    assert state.read_text().strip() in frozen

    lingering = sandbox_hosts.kill_all(procs, timeout_s=10)

    assert lingering == [], f"still alive after SIGKILL: {[(p.pid, p.status()) for p in lingering]}"


def test_thaw_leaves_a_running_or_vanished_process_alone(sandboxes):
    handle = sandboxes.create()
    procs, (state, frozen, _) = container_processes(sandboxes, handle.container)
    before = state.read_text().strip()
    assert before not in frozen
    assert freezer.thaw(procs[0].pid) is False
    assert state.read_text().strip() == before
    assert freezer.thaw(2**22 + 1) is False  # above any pid_max: no such process
