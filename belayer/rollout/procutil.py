"""Process helpers shared by the owner and engine children. No torch or vLLM import: an
engine's environment must be set before either loads (`engine_environment`)."""

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


def engine_environment(threads: int) -> dict[str, str]:
    """Environment an engine process needs before vLLM (and with it torch and OpenMP) is
    imported: vLLM reads its logging level and OpenMP its settings once, when they load
    (docs/design.md §7).

    OMP_WAIT_POLICY=PASSIVE: an OpenMP thread that finished its share of an operation sleeps
    instead of spinning for the next one. A tiny model's decode step is hundreds of small
    operations, so the spinning thread burned about as much CPU as the one doing the work,
    CPU the sandboxes and the other engine needed. Measured on this machine (2 cores, dev
    stack, 64 multistep trajectories at once, two runs each): engine CPU 36.0 / 31.2 s ->
    21.2 / 18.4 s, the run's wall time 67.7 / 63.0 s -> 53.2 / 49.5 s, the same tokens."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: ~7 s cold start, one pid to fence
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",  # the KV hook targets the V1 CPU model runner
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),  # an explicit setting wins
    }
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    # vLLM's INFO lines from every engine drown the node's own log; an explicit setting wins.
    env["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")
    return env


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
