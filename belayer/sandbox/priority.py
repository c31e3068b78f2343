"""Background CPU priority for work that overlaps a generation.

A checkpoint is taken while the rollout engine generates the next turn, on the same
cores when the engine and the sandbox share a host (as on one machine). The engine's
decode splits each step across its threads, so any core the checkpoint holds stalls
every step: measured on the 2-core dev machine, a checkpoint overlapping a generation
slowed it by about a third. Run at a higher niceness, the checkpoint (podman, runc,
CRIU, the compressor and the upload threads, which all inherit the calling thread's
niceness on Linux) takes the cycles the engine leaves, and the engine keeps its speed.

Niceness is per thread on Linux, so the work runs on a thread of its own, which is
raised once and ends with the work: no pooled thread is left lowered, and no privilege
is needed (raising niceness never is).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def at_niceness(nice: int, fn: Callable[[], T]) -> T:
    """`fn()` on a new thread whose niceness is raised by `nice` (0: here, unchanged);
    its result or exception is the caller's."""
    if nice <= 0:
        return fn()
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _raised(nice))
            outcome["result"] = fn()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="belayer-background", daemon=True)
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]


def _raised(nice: int) -> int:
    return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)
