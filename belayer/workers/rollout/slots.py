"""The shared rollout queue polled only while the node has room.

A node refuses a request past its declared capacity (belayer/rollout/admission.py). On
its own queue that refusal sends the turn to the shared queue at once; but a full node
that went on polling the shared queue would take turns there only to refuse them, and
each would wait out a retry's backoff while another node had room. So the node's
shared-queue worker reserves an activity slot, and so polls, only while the node could
admit one more request: Temporal leaves the turn to a node with room, or keeps it queued
(visible in the Temporal UI) until one has some.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from temporalio.worker import (
    CustomSlotSupplier,
    FixedSizeSlotSupplier,
    SlotMarkUsedContext,
    SlotPermit,
    SlotReleaseContext,
    SlotReserveContext,
    WorkerTuner,
)

ROOM_POLL_S = 0.05  # how often a full node looks again (a reservation waits only when full)
OTHER_SLOTS = 100  # workflow, local-activity and Nexus slots: Temporal's own default


class RoomSlots(CustomSlotSupplier):
    """At most `limit` activity slots, each reserved only while `has_room()`."""

    def __init__(self, has_room: Callable[[], bool], limit: int) -> None:
        self.has_room, self.limit = has_room, limit
        self.held = 0

    async def reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit:
        while not self._free():
            await asyncio.sleep(ROOM_POLL_S)
        self.held += 1
        return SlotPermit()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        if not self._free():
            return None
        self.held += 1
        return SlotPermit()

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        pass

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        self.held -= 1

    def _free(self) -> bool:
        return self.held < self.limit and self.has_room()


def room_tuner(has_room: Callable[[], bool], limit: int) -> WorkerTuner:
    """A worker's slots: activities as `RoomSlots` gives them, the rest Temporal's default."""
    return WorkerTuner.create_composite(
        workflow_supplier=FixedSizeSlotSupplier(OTHER_SLOTS),
        activity_supplier=RoomSlots(has_room, limit),
        local_activity_supplier=FixedSizeSlotSupplier(OTHER_SLOTS),
        nexus_supplier=FixedSizeSlotSupplier(OTHER_SLOTS),
    )
