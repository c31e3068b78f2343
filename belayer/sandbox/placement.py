"""Where a new or recovered sandbox goes: the least loaded sandbox host with room.

Every sandbox worker publishes its load to the object store, `hosts/<host queue>.json`:
its live sandboxes, its capacity (`sandbox.max_sandboxes`), whether it is draining and
when it wrote -- on every change and every `HEARTBEAT_S`, and it removes the record when
it stops. `choose` reads them all (one LIST, one GET per host) and picks the host with
the fewest sandboxes among the fresh ones that are neither full nor draining; hosts that
are equally loaded are told apart by a hash of the sandbox id, so a burst of placements
that all read the same loads still spreads. A record older than `STALE_AFTER_S` is of a
host that died without removing it: skipped. When every fresh host is full or draining,
the sandbox waits for room (the workflow asks again).

Placement is advice. The host enforces its capacity itself (`HostFull`): of two
placements that raced for its last slot, one is refused, and its workflow asks again,
avoiding that host (belayer/workflows/trajectory.py, `_on_placed_host`). With no record
at all (hosts of an older Belayer, a store they cannot reach) everything goes to the
shared queue, as before placement existed.
"""

from __future__ import annotations

import hashlib
import logging
import threading

from pydantic import BaseModel, ConfigDict, Field

from belayer.storage.errors import StorageError

log = logging.getLogger(__name__)

PREFIX = "hosts/"
HEARTBEAT_S = 5.0
STALE_AFTER_S = 3 * HEARTBEAT_S


class HostLoad(BaseModel):
    """What one sandbox host publishes about itself."""

    model_config = ConfigDict(extra="forbid")

    host_queue: str
    sandboxes: int = Field(ge=0, description="Live sandboxes, and the ones being started.")
    capacity: int = Field(ge=0, description="sandbox.max_sandboxes; 0: no limit.")
    draining: bool = False
    written_at: float = Field(description="Unix time of the write.")

    def fresh(self, now: float) -> bool:
        """Written within STALE_AFTER_S: an older record is of a host that died without removing it."""
        return now - self.written_at <= STALE_AFTER_S

    def has_room(self) -> bool:
        return not self.draining and (self.capacity == 0 or self.sandboxes < self.capacity)


def record_key(host_queue: str) -> str:
    return f"{PREFIX}{host_queue}.json"


def publish(store, load: HostLoad) -> None:
    store.put_bytes(record_key(load.host_queue), load.model_dump_json().encode())


def withdraw(store, host_queue: str) -> None:
    store.delete(record_key(host_queue))


def read_loads(store) -> list[HostLoad]:
    """Every host's record; an unreadable one is skipped (that host is not chosen)."""

    loads = []
    for key in store.list(PREFIX):
        try:
            loads.append(HostLoad.model_validate_json(store.get_bytes(key)))
        except (StorageError, ValueError) as exc:
            log.warning("host load record %s unusable, skipped: %s", key, exc)
    return loads


def choose(loads: list[HostLoad], *, now: float, key: str, avoid: frozenset[str] = frozenset()) -> str | None:
    """The host queue for sandbox `key`; None when no fresh host has room (use the shared queue).

    `avoid` (the host that just lost the sandbox) is taken only when no other host has room.
    """
    fresh = [load for load in loads if load.fresh(now) and load.has_room()]
    preferred = [load for load in fresh if load.host_queue not in avoid] or fresh
    if not preferred:
        return None

    def order(load: HostLoad) -> tuple[int, str]:
        return load.sandboxes, hashlib.sha256(f"{key}\0{load.host_queue}".encode()).hexdigest()

    return min(preferred, key=order).host_queue


def spread(
    loads: list[HostLoad], keys: list[str], *, now: float, avoid: frozenset[str] = frozenset()
) -> list[str | None]:
    """A host for each of `keys` (a group's forks), chosen one after another as `choose`
    chooses, each choice counted in its host's load before the next: the forks fill the
    least loaded hosts with room, none past its capacity. None for a key no host has
    room for."""
    counted = {load.host_queue: load.model_copy() for load in loads}
    chosen: list[str | None] = []
    for key in keys:
        queue = choose(list(counted.values()), now=now, key=key, avoid=avoid)
        if queue is not None:
            counted[queue] = counted[queue].model_copy(update={"sandboxes": counted[queue].sandboxes + 1})
        chosen.append(queue)
    return chosen


def any_fresh(loads: list[HostLoad], *, now: float) -> bool:
    """Whether some host publishes its load at all: with none, the shared queue is the answer;
    with some but no room, the sandbox waits for room."""
    return any(load.fresh(now) for load in loads)


class LoadPublisher:
    """Keeps one host's record fresh: at once after each change, else every HEARTBEAT_S;
    `stop` removes it, so placement stops choosing the host the moment it leaves."""

    def __init__(self, host):
        self.host = host
        self._changed = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-load", daemon=True)
        host.on_load_change = self._changed.set

    def start(self) -> LoadPublisher:
        """Publish once (the host is placeable when this returns), then keep it fresh."""
        self._publish()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._changed.wait(HEARTBEAT_S)
            self._changed.clear()
            if not self._stopped.is_set():
                self._publish()

    def _publish(self) -> None:
        try:
            publish(self.host.store, self.host.load())
        except Exception as exc:  # noqa: BLE001 -- a store outage: the record goes stale, placement skips it
            log.warning("publishing the load of %s failed: %s", self.host.host_queue, exc)

    def stop(self) -> None:
        self._stopped.set()
        self._changed.set()
        self._thread.join(timeout=10)
        try:
            withdraw(self.host.store, self.host.host_queue)
        except Exception as exc:  # noqa: BLE001 -- it goes stale instead
            log.warning("withdrawing the load record of %s failed: %s", self.host.host_queue, exc)
