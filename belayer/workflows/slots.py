"""The sandboxes a batch holds at once, bounded: `Slots`, taken several at a time, first
come first served.

Workflow code: it waits through `workflow.wait_condition`, nothing else.
"""

from __future__ import annotations

from temporalio import workflow


class Slots:
    """At most `limit` taken at once. A taker of n waits until it is first in line and n
    are free: a group takes its members' slots together before it forks them (a forked
    sandbox is live while its member waits), since two groups each holding part of what
    they need would wait for each other forever; the line keeps a group from being passed
    over by single members."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self._line: list[object] = []

    async def take(self, n: int = 1) -> None:
        if not 1 <= n <= self.limit:
            raise ValueError(f"cannot take {n} slots of {self.limit}")
        turn = object()
        self._line.append(turn)
        try:
            await workflow.wait_condition(lambda: self._line[0] is turn and self.taken + n <= self.limit)
        finally:
            self._line.remove(turn)
        self.taken += n

    def give(self, n: int = 1) -> None:
        self.taken -= n
