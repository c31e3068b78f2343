"""Placement: the least loaded fresh host with room, spread by sandbox id; a full host
refuses new sandboxes (real podman); each host's load record in the real store follows
its sandboxes and goes when it stops."""

from __future__ import annotations

import time

import pytest

from belayer.sandbox import placement
from belayer.sandbox.errors import HostFull
from belayer.sandbox.placement import HostLoad, LoadPublisher, choose
from belayer.storage.errors import ObjectNotFound
from tests.sandbox.conftest import make_sandboxes

NOW = 1_000_000.0


def load(
    queue: str, sandboxes: int, *, capacity: int = 4, draining: bool = False, age_s: float = 1.0
) -> HostLoad:
    return HostLoad(host_queue=queue, sandboxes=sandboxes, capacity=capacity, draining=draining,
                    written_at=NOW - age_s)  # fmt: skip


def test_the_least_loaded_host_with_room_is_chosen():
    loads = [load("a", 3), load("b", 1), load("c", 2)]
    assert choose(loads, now=NOW, key="sbx-1") == "b"


def test_full_draining_and_stale_hosts_are_never_chosen():
    loads = [load("full", 4), load("draining", 0, draining=True), load("stale", 0, age_s=60), load("ok", 3)]
    assert choose(loads, now=NOW, key="sbx-1") == "ok"
    assert choose(loads[:3], now=NOW, key="sbx-1") is None  # the shared queue
    assert choose([load("unlimited", 500, capacity=0)], now=NOW, key="sbx-1") == "unlimited"


def test_the_host_that_lost_a_sandbox_is_taken_only_when_no_other_has_room():
    assert (
        choose([load("lost-it", 0), load("other", 3)], now=NOW, key="sbx-1", avoid=frozenset({"lost-it"}))
        == "other"
    )
    assert choose([load("lost-it", 0), load("other", 4)], now=NOW, key="sbx-1",
                  avoid=frozenset({"lost-it"})) == "lost-it"  # fmt: skip


def test_equally_loaded_hosts_share_a_burst_of_placements():
    loads = [load("a", 0), load("b", 0)]
    chosen = [choose(loads, now=NOW, key=f"sbx-{i:04d}") for i in range(200)]
    assert 60 <= chosen.count("a") <= 140, chosen.count("a")
    assert chosen == [choose(loads, now=NOW, key=f"sbx-{i:04d}") for i in range(200)]  # deterministic


def test_a_full_host_refuses_new_sandboxes_and_publishes_its_load(sandbox_runtime, storage_config):
    boxes = make_sandboxes(storage_config, max_sandboxes=1)
    store, queue = boxes.host.store, boxes.host.host_queue
    publisher = LoadPublisher(boxes.host).start()
    try:
        assert _published(store, queue, sandboxes=0).capacity == 1
        first = boxes.create()
        with pytest.raises(HostFull, match="max_sandboxes=1"):
            boxes.create()
        assert _published(store, queue, sandboxes=1).has_room() is False  # the refused one left no trace
        boxes.host.destroy(first)
        assert _published(store, queue, sandboxes=0).has_room()
        boxes.create()  # room again
        assert _published(store, queue, sandboxes=1)
    finally:
        publisher.stop()
        leaked = boxes.cleanup()
    assert not list(store.list(placement.record_key(queue)))  # withdrawn at stop: placement skips it at once
    store.close()
    assert not leaked, leaked


def _published(store, host_queue: str, *, sandboxes: int) -> HostLoad:
    """The host's record once it shows `sandboxes` (the publisher writes from its own thread)."""
    record = None
    for _ in range(100):
        try:
            record = HostLoad.model_validate_json(store.get_bytes(placement.record_key(host_queue)))
        except ObjectNotFound:  # not written yet
            record = None
        if record is not None and record.sandboxes == sandboxes:
            return record
        time.sleep(0.05)
    raise AssertionError(f"the load record of {host_queue} never showed {sandboxes} sandboxes: {record}")
