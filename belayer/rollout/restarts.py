"""When to start a child again after it died, and when to call the node degraded.

A shadow or memory owner that cannot start (a bad driver, memory it cannot get, a segment
that no longer verifies) would otherwise be respawned at once, forever: each attempt loads
a model or hashes every tensor, on the CPU the leader serves with. The first restart is
immediate (one death is the normal case: a crash, a kill), later ones back off
exponentially; after `DEGRADED_AFTER` failures in a row the node reports itself degraded
and goes on serving with what it has, trying again at the longest backoff. A child that
was ready for `STABLE_S` before it died starts the count again: a new failure, not a loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 300.0
DEGRADED_AFTER = 3
STABLE_S = 60.0


class Restarts:
    """One role's failures in a row, the earliest next start, and the degraded reason."""

    def __init__(self, role: str, meanwhile: str, clock: Callable[[], float] = time.monotonic):
        self.role, self.meanwhile = role, meanwhile  # what the node does while it is degraded
        self._clock = clock
        self.failures = 0
        self.next_start_at = 0.0
        self.ready_at: float | None = None
        self.degraded: str | None = None

    def started(self) -> None:
        self.ready_at = None

    def ready(self) -> None:
        """It is up again: the node is whole."""
        self.ready_at = self._clock()
        self.degraded = None

    def died(self, why: str) -> float:
        """Record a death; returns the delay before the next start (0 for a first failure)."""
        now = self._clock()
        if self.ready_at is not None and now - self.ready_at >= STABLE_S:
            self.failures = 0
        self.ready_at = None
        self.failures += 1
        delay = 0.0 if self.failures == 1 else min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (self.failures - 2))
        self.next_start_at = now + delay
        if self.failures >= DEGRADED_AFTER:
            self.degraded = (
                f"the {self.role} failed {self.failures} times in a row (last: {why}); "
                f"{self.meanwhile}; next start in {delay:.0f} s"
            )
        return delay

    def due(self) -> bool:
        return self._clock() >= self.next_start_at
