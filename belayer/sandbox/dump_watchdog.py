"""Ends a checkpoint that the agent wedged, and thaws its sandbox.

CRIU (4.2.1 here, cgroup v1 freezer) waits forever in ptrace_attach on a task that was
stopped (SIGSTOP) when podman froze the container's cgroup, and holds the container's
lock meanwhile: every later podman call on the host that lists or touches the container
waits too, `podman ps` included, so one sandbox would stall its whole host. The host
resumes every stopped process right before a dump (the supervisor's `quiesce`), but an
agent that keeps stopping one (a loop of `kill -STOP`) wins that race every time.

`DumpWatchdog` watches the process tree of one `podman container checkpoint`. When CRIU
sits in ptrace_attach while the container's cgroup is frozen, on two polls in a row (an
attach is otherwise instant; a stopped task, frozen, shows as "D" like every other, so
the wedge is told by CRIU's wait), it kills CRIU and thaws the container's cgroup:
podman then fails, the sandbox runs on as it was (a `--leave-running` dump changes
nothing in it), and the caller raises `CheckpointBlockedByAgent`. It reads /proc, the runc state and the cgroup (thawing as
belayer/sandbox/freezer.py does); a dump that does not wedge costs a thread that sleeps
until the dump ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from belayer.sandbox import freezer
from belayer.sandbox.errors import CheckpointBlockedByAgent

RUNC_ROOT = Path("/run/runc")  # runc's default state root, which podman's rootful runc uses
FIRST_LOOK_S = 1.0  # a dump of a small sandbox takes about a second; nothing to look at before
POLL_S = 0.5
WEDGED_POLLS = 2  # consecutive polls that must see the wedge (a ptrace_attach is otherwise instant)


@dataclass
class DumpWatchdog:
    """Watches the checkpoint whose podman process is `podman_pid` (a context manager).

    `wedged` says the watchdog ended a wedged dump, `stopped` the container's tasks it
    then found stopped; `raise_if_wedged` turns that into the caller's error."""

    podman_pid: int
    container: str
    wedged: bool = False
    stopped: list[int] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> DumpWatchdog:
        self._thread = threading.Thread(
            target=self._watch, name=f"dump-watchdog-{self.container}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def raise_if_wedged(self) -> None:
        if self.wedged:
            which = f"process(es) {self.stopped}" if self.stopped else "processes"
            raise CheckpointBlockedByAgent(
                f"checkpoint of {self.container}: the agent's {which} were stopped (SIGSTOP) "
                "as the dump froze the sandbox, which CRIU cannot dump; the dump was ended and the sandbox thawed. "
                "The sandbox runs on without this checkpoint; one the agent does not keep stopping succeeds."
            )

    def _watch(self) -> None:
        if self._done.wait(FIRST_LOOK_S):
            return
        seen = 0
        while not self._done.is_set():
            wedge = find_wedge(self.podman_pid)
            seen = seen + 1 if wedge else 0
            if wedge and seen >= WEDGED_POLLS:
                criu, init_pid = wedge
                with contextlib.suppress(ProcessLookupError):
                    os.kill(criu, signal.SIGKILL)
                freezer.thaw(init_pid)
                self.wedged = True
                time.sleep(POLL_S)  # the stopped task, thawed, shows as stopped again
                self.stopped = [tid for tid in freezer.tasks(init_pid) if _stopped(tid)]
                return
            self._done.wait(POLL_S)


def find_wedge(podman_pid: int) -> tuple[int, int] | None:
    """(CRIU's pid, the container's first process) when the dump under `podman_pid` waits
    in ptrace_attach with the container's cgroup frozen."""
    tree = descendants(podman_pid)
    criu = next((pid for pid in tree if _wchan(pid) == "ptrace_attach"), None)
    runc_id = next((cid for pid in tree if (cid := _runc_checkpoint_target(pid))), None)
    if criu is None or runc_id is None:
        return None
    init_pid = container_init_pid(runc_id)
    return (criu, init_pid) if init_pid is not None and freezer.is_frozen(init_pid) else None


def descendants(root: int) -> list[int]:
    """Every process below `root` (podman, runc, CRIU)."""
    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return []


def container_init_pid(container_id: str) -> int | None:
    """The host pid of the container's first process, as runc recorded it."""
    try:
        return int(json.loads((RUNC_ROOT / container_id / "state.json").read_text())["init_process_pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _runc_checkpoint_target(pid: int) -> str | None:
    """The container id a `runc ... checkpoint ... ID` process dumps (its last argument)."""
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return None
    if len(argv) > 2 and argv[0].endswith("runc") and "checkpoint" in argv:
        return argv[-1]
    return None


def _stopped(tid: int) -> bool:
    try:
        return psutil.Process(tid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _wchan(pid: int) -> str:
    """Where in the kernel `pid` waits (psutil does not say)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return ""
