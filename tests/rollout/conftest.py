"""Fixtures for the rollout node tests: the tiny model and real nodes that always clean up.

A node start costs 20 to 40 seconds on two cores, so modules whose nodes have the same
configuration share them through a session-wide `NodePool`, one node per configuration
(node id aside). Tests that break a node recover it through the node's own recovery path;
a node given back not as it started (a publish moved its version, it is broken, its shadow
never came back) is closed then and there, so the next module starts a fresh one. Every
node's processes and shared-memory segments are checked gone when it closes: when given
back changed, or at the end of the session.
"""

from __future__ import annotations

import os
import signal
import time
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
from tests.tiers import needs  # noqa: E402


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


class NodePool:
    """Started nodes shared across the session's modules, at most one idle node per
    configuration (its node id aside) and model. A node is handed out only as it started:
    serving the built model as version 1, with no weight source, not broken, its owner
    alive and its shadow ready (when it has one); any other is closed instead, and its
    leftovers are reported."""

    def __init__(self):
        self._idle: dict[tuple[str, str], NodeUnderTest] = {}
        self._leaks: list[str] = []

    @staticmethod
    def _key(config: RolloutConfig, model_dir: Path) -> tuple[str, str]:
        return str(model_dir), config.model_dump_json(exclude={"node_id"})

    def checkout(self, config: RolloutConfig, model_dir: Path) -> NodeUnderTest:
        """An idle node of this configuration as it started, or a newly started one."""
        nut = self._idle.pop(self._key(config, model_dir), None)
        if nut is not None and as_started(nut.node):
            nut.remember()
            return nut
        if nut is not None:  # changed while idle: reported at the end of the session
            self._leaks += self._close(nut)
        nut = NodeUnderTest(config, model_dir)
        nut.start()
        return nut

    def give_back(self, nut: NodeUnderTest) -> None:
        """Keep the node for the next module if it is as it started; else close it now and
        fail on anything it leaked."""
        nut.remember()
        key = self._key(nut.node.config, nut.node.model_dir)
        if key not in self._idle and as_started(nut.node):
            self._idle[key] = nut
            return
        left = self._close(nut)
        assert not left, f"node leaked: {left}"

    def close_all(self) -> None:
        """Close every idle node; fail on anything any node of the pool leaked."""
        while self._idle:
            self._leaks += self._close(self._idle.popitem()[1])
        assert not self._leaks, f"nodes leaked: {self._leaks}"

    @staticmethod
    def _close(nut: NodeUnderTest) -> list[str]:
        return [f"{nut.node.config.node_id}: {item}" for item in nut.close()]


def as_started(node: RolloutNode) -> bool:
    """Whether a node can be handed to another module as if newly started."""
    if node.target_version != 1 or node.weight_source is not None or node.roles().broken is not None:
        return False
    settled = _settles(lambda: (roles := node.roles()).publishing is None and roles.owner_state == "alive")
    return settled and (not node.config.shadow or node.wait_shadow_ready())


def _settles(condition, timeout: float = 60.0) -> bool:
    """Whether `condition()` holds within `timeout` (an owner being replaced, a publish
    finishing after a recovery test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="session")
@needs("engine")
def node_pool(tiny_model) -> NodePool:
    """The session's shared nodes, closed (and checked for leaks) at its end."""
    pool = NodePool()
    yield pool
    pool.close_all()


def pooled_node(pool: NodePool, config: RolloutConfig, model_dir: Path):
    """Yield a `NodeUnderTest` of this configuration from the pool; give it back afterwards."""
    nut = pool.checkout(config, model_dir)
    try:
        yield nut
    finally:
        pool.give_back(nut)


@pytest.fixture(scope="module", params=["private", "shared"])
def node_under_test(request, node_pool, tiny_model):
    yield from pooled_node(node_pool, node_config(weight_mode=request.param), tiny_model)


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
    from belayer.storage.store import open_store

    with open_store(storage_config, encrypted=False) as s:
        yield s
