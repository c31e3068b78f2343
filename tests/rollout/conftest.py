"""Fixtures for the rollout node tests: the tiny model and real nodes that always clean up.

Nodes are module-scoped (one per weight mode) because an engine start costs seconds on
two cores; tests that break a node recover it through the node's own recovery path, and
every node's processes and shared-memory segments are checked gone at teardown.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from belayer.rollout import shm  # noqa: E402
from belayer.rollout.config import RolloutConfig  # noqa: E402
from belayer.rollout.node import RolloutNode  # noqa: E402
from belayer.rollout.protocol import SamplingSpec  # noqa: E402
from belayer.rollout.status import OwnerRecovery  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402, F401 (fixture)


def node_config(**overrides) -> RolloutConfig:
    base = dict(
        node_id="t" + uuid.uuid4().hex[:8],
        model="tiny",
        dtype="float32",
        kv_cache_mb=64,
        max_model_len=1024,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=5.0,  # generous bounds: other jobs on 2 cores can starve a healthy engine
        hang_floor_s=4.0,
        weights_verify_interval_s=0,
    )
    base.update(overrides)
    return RolloutConfig(**base)


def flip_a_weight_byte(weights: Path) -> None:
    """Damage a weights segment: one byte inside its first tensor's data."""
    with open(weights, "r+b") as f:
        header = shm.read_weights_header(shm.map_readonly(weights))
        f.seek(header.data_offset + 128)
        byte = f.read(1)
        f.seek(header.data_offset + 128)
        f.write(bytes([byte[0] ^ 0xFF]))


def owner_recovery_after(node: RolloutNode, generation: int) -> OwnerRecovery | None:
    """The node's record of being protected again after an owner death, once an owner
    newer than `generation` has brought it there (the loop writes it after `protected`)."""
    record = node.roles().last_owner_recovery
    return record if record and record.owner_generation > generation else None


def leftovers(node_id: str, pids: list[int]) -> list[str]:
    """What a closed node left behind: live child processes and shm segments."""
    found = [f"shm {p}" for p in shm.leftover_segments(node_id)]
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] != "Z":
                found.append(f"process {pid}")
    return found


class NodeUnderTest:
    """A started node plus every pid it ever had, so teardown can prove nothing leaked."""

    def __init__(self, config: RolloutConfig, model_dir: Path):
        self.node = RolloutNode(config, model_dir)
        self.seen_pids: set[int] = set()

    def start(self) -> RolloutNode:
        self.node.start()
        self.remember()
        return self.node

    def remember(self) -> None:
        self.seen_pids.update(self.node.pids().values())

    def close(self) -> list[str]:
        self.remember()
        self.node.close()
        left = leftovers(self.node.config.node_id, sorted(self.seen_pids))
        for item in left:  # clean up even what the node failed to, then report it
            if item.startswith("process "):
                try:
                    os.kill(int(item.split()[1]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shm.unlink_segments(self.node.config.node_id)
        return left


def started_node(config: RolloutConfig, model_dir: Path):
    """Yield a started `NodeUnderTest`; afterwards close it and fail on anything it leaked."""
    nut = NodeUnderTest(config, model_dir)
    try:
        nut.start()
        yield nut
    finally:
        left = nut.close()
    assert not left, f"node leaked: {left}"


@pytest.fixture(scope="module", params=["private", "shared"])
def node_under_test(request, tiny_model):
    yield from started_node(node_config(weight_mode=request.param), tiny_model)


@pytest.fixture
def node(node_under_test) -> RolloutNode:
    """The module's node, with its shadow ready (a previous test may have used it)."""
    n = node_under_test.node
    assert n.wait_shadow_ready(), "shadow did not come back"
    node_under_test.remember()
    return n


PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13], list(range(100, 140)), [1500, 3, 4], list(range(300, 302))]
SPECS = [
    SamplingSpec(max_tokens=240, ignore_eos=True),
    SamplingSpec(max_tokens=240, temperature=0.8, seed=11, ignore_eos=True),
    SamplingSpec(max_tokens=200, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True),
    SamplingSpec(max_tokens=220, temperature=1.2, top_k=50, seed=7, ignore_eos=True),
    SamplingSpec(max_tokens=160, ignore_eos=True),
]


@pytest.fixture
def store(storage_config):
    """The real object store of the test stack (SeaweedFS)."""
    from belayer.storage.store import ObjectStore

    with ObjectStore(storage_config) as s:
        yield s
