"""`Slots`: granted in line order, a group never passed over by single takers, a cancelled
taker holding nothing. Plain asyncio: Slots waits on futures only, as a workflow's loop runs them."""

from __future__ import annotations

import asyncio

import pytest

from belayer.workflows.slots import Slots


async def test_takers_are_served_in_line_and_a_group_is_not_passed_over():
    slots, order = Slots(4), []

    async def taker(name: str, n: int) -> None:
        await slots.take(n)
        order.append(name)

    await slots.take(3)
    waiting = [asyncio.create_task(taker(name, n)) for name, n in [("group", 3), ("single", 1)]]
    await asyncio.sleep(0)
    assert order == [] and slots.taken == 3, "one slot is free, but the group is first in line"
    slots.give(3)
    await asyncio.gather(*waiting)
    assert order == ["group", "single"] and slots.taken == 4


async def test_a_cancelled_taker_takes_nothing_and_lets_the_line_move():
    slots = Slots(2)
    await slots.take(2)
    cancelled, behind = asyncio.create_task(slots.take(2)), asyncio.create_task(slots.take(1))
    await asyncio.sleep(0)
    cancelled.cancel()
    slots.give(1)  # before the cancelled taker hears of it
    await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await behind
    assert slots.taken == 2


async def test_taking_more_than_the_limit_is_refused():
    with pytest.raises(ValueError, match="cannot take 5 slots of 4"):
        await Slots(4).take(5)
