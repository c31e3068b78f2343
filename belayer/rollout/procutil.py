"""Process helpers shared by the owner and engine children."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this child when the supervisor dies: nothing is left behind.

    Also points the child's stdout at stderr: vLLM logs to stdout, and the supervisor's
    stdout belongs to its caller (e.g. `belayer bench ... --json`)."""
    os.dup2(2, 1)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def memory_of(pid: int) -> tuple[int, int, int]:
    """(rss, private, shared) bytes of a process, from /proc/<pid>/smaps_rollup."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    shared = fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0)
    return fields.get("Rss", 0), private, shared


BACKGROUND_NICENESS = 19


def run_in_background() -> None:
    """Lowest CPU priority for this process and every thread it creates later: a shadow
    initializing (or idling) must never slow the leader that re-prefills after a takeover."""
    os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICENESS)


def set_niceness(niceness: int) -> bool:
    """Every thread of this process to `niceness` (Linux keeps one per thread). Lowering it
    needs CAP_SYS_NICE; without it the engine stays where it is, which matters only while
    another process competes for the cores. False then."""
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
            except ProcessLookupError:  # a thread that just exited
                pass
    except PermissionError:
        return False
    return True
