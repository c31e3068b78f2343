"""The sandboxes a batch holds at once, bounded: `Slots`, taken several at a time, first
come first served.

Workflow code: it waits on futures the workflow's own event loop resolves (`Slots`), or
through `workflow.wait_condition` (`PolledSlots`, the runs from before), nothing else.
"""

from __future__ import annotations

import asyncio
from collections import deque

from temporalio import workflow


class Slots:
    """At most `limit` taken at once. A taker of n waits until it is first in line and n
    are free: a group takes its members' slots together before it forks them (a forked
    sandbox is live while its member waits), since two groups each holding part of what
    they need would wait for each other forever; the line keeps a group from being passed
    over by single members.

    Each taker waits on a future of its own, granted in line order as slots are given
    back: a take and a give cost the same however many wait. (A condition per waiter, as
    `PolledSlots` has, is re-evaluated for every waiter whenever anything happens: with a
    thousand groups waiting, one workflow task outran Temporal's 2 s deadlock detector.)"""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self._line: deque[tuple[int, asyncio.Future]] = deque()

    async def take(self, n: int = 1) -> None:
        if not 1 <= n <= self.limit:
            raise ValueError(f"cannot take {n} slots of {self.limit}")
        turn = asyncio.get_running_loop().create_future()
        self._line.append((n, turn))
        self._grant()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give(n)  # granted as it was cancelled: the slots go back
            elif (n, turn) in self._line:
                self._line.remove((n, turn))
                self._grant()
            raise

    def give(self, n: int = 1) -> None:
        self.taken -= n
        self._grant()

    def _grant(self) -> None:
        while self._line and self.taken + self._line[0][0] <= self.limit:
            n, turn = self._line.popleft()
            if turn.done():  # cancelled, its taker not yet told: it takes nothing
                continue
            self.taken += n
            turn.set_result(None)


class PolledSlots:
    """`Slots` as runs started before SLOTS_IN_LINE_PATCH wait for them: through a
    `workflow.wait_condition` per waiter (their histories replay with it)."""

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
