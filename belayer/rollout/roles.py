"""Who holds which role in a node: the owner, leader and shadow processes, and the lease.

`Roles` holds the children by role, the lease epoch and the owner generation the engines
load from; it starts engines and moves the lease, because a takeover, a cold start and the
node's own start all do exactly that and must agree on how. `ShadowRole` keeps the node
supplied with a shadow: started on the right version, replaced with backoff when it dies
or falls behind. Both run on the node's loop thread (or before the loop starts); the node
lock guards only the swap of a handle, which any thread may read.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from belayer.rollout import children
from belayer.rollout.children import Child
from belayer.rollout.errors import EngineStartError, RolloutError
from belayer.rollout.protocol import LeaseTaken, TakeLease
from belayer.rollout.restarts import Restarts

if TYPE_CHECKING:
    from belayer.rollout.node import RolloutNode

log = logging.getLogger("belayer.rollout")

ROLES = ("owner", "leader", "shadow")


class Roles:
    """The owner, leader and shadow of one node, the lease epoch and the owner generation."""

    def __init__(self, node: RolloutNode):
        self._node = node
        self.owner: Child | None = None
        self.leader: Child | None = None
        self.shadow: Child | None = None
        self.generation = 0  # of the owner: a new owner gets a new one, and new segment names
        self.epoch = 0  # of the lease, as the arena header records it
        self.reference_digest: str | None = None  # the first leader's device digest

    def set(self, role: str, child: Child | None) -> Child | None:
        """Give `role` to `child` (None: nobody holds it); returns its previous holder."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}")
        with self._node.lock:
            old = getattr(self, role)
            setattr(self, role, child)
        self._node.notify_state()
        return old

    def engine_versions(self) -> set[int]:
        """The weights versions the leader and the shadow compute with."""
        return {c.version for c in (self.leader, self.shadow) if c is not None}

    def pids(self) -> dict[str, int]:
        with self._node.lock:
            return {
                c.role if c is not self.leader else "leader": c.pid
                for c in (self.owner, self.leader, self.shadow)
                if c
            }

    def spawn_engine(self, role: str, version: int | None = None) -> Child:
        """An engine on `version` (default: the version the node serves)."""
        node = self._node
        version = node.target_version if version is None else version
        if version not in node.owner_role.versions:
            raise RolloutError(
                f"the memory owner does not hold weights version {version} "
                f"({node.owner_role.restore_failure or 'it is being restored'}); no engine can load it"
            )
        weights = (version, node.owner_role.versions[version])
        return children.spawn_engine(
            node.config, node.model_dir, weights, self.owner.ready.arena_path, self.generation, role
        )

    def await_engine(self, engine: Child) -> None:
        config = self._node.config
        children.await_ready(engine, config.engine_start_timeout_s, self._node.dispatch)
        if engine.switching_to is not None:
            deadline = time.monotonic() + config.engine_start_timeout_s
            while engine.switching_to is not None and time.monotonic() < deadline:
                if engine.conn.poll(0.05):
                    children.drain(engine, self._node.dispatch)
                elif not engine.process.is_alive():
                    raise RolloutError(f"{engine.role} (pid {engine.pid}) died while switching weights")

    def take_lease(self, engine: Child) -> None:
        """`engine` takes the arena lease (the epoch goes up); it is not the leader until
        `set("leader", engine)`."""
        node = self._node
        reply = children.call(engine, TakeLease(), LeaseTaken, node.config.control_timeout_s, node.dispatch)
        self.epoch = reply.epoch
        engine.last_heard = time.monotonic()  # its silence is measured from becoming leader


class ShadowRole:
    """Keeps a shadow ready on the version the leader would have to serve after a takeover."""

    def __init__(self, node: RolloutNode):
        self._node = node
        self.restarts = Restarts(
            "shadow", "serving with the leader alone (a leader failure means a cold start)"
        )

    def await_first(self) -> None:
        """The first shadow: a node whose shadow cannot start still serves (degraded later)."""
        try:
            self._node.holders.await_engine(self._node.holders.shadow)
            self.restarts.ready()
        except EngineStartError as exc:
            self.on_death(str(exc))

    def on_death(self, why: str | None = None) -> None:
        node = self._node
        shadow = node.holders.set("shadow", None)
        children.stop(shadow)
        why = why or f"pid {shadow.pid} exited with {shadow.process.exitcode}" + (
            "" if shadow.ready else " while starting"
        )
        delay = self.restarts.died(why)
        log.error("rollout node %s: shadow %s; next shadow start in %.0f s", node.config.node_id, why, delay)
        if self.restarts.degraded:
            log.error("rollout node %s: degraded: %s", node.config.node_id, self.restarts.degraded)
        node.notify_state()

    def start_if_due(self) -> None:
        """Start a shadow if the node should have one and has none, once its backoff allows
        (loop thread; a recovery calls it too, so a takeover is followed by a new shadow)."""
        node = self._node
        version = self._version_to_load()
        if (
            not node.config.shadow
            or node.holders.shadow is not None
            or node.holders.leader is None
            or node.broken
            or node.owner_role.failure is not None
            or version not in node.owner_role.versions
            or not self.restarts.due()
        ):
            return
        self.restarts.started()
        node.holders.set("shadow", node.holders.spawn_engine("shadow", version))

    def _version_to_load(self) -> int:
        """What a new shadow loads: while a finish-on-old drain keeps the leader on the
        version its requests are pinned to, that version (a takeover meanwhile must finish
        them on it; a shadow on the new one would un-pin them), and the shadow follows the
        leader to the new one afterwards; otherwise the version the node serves."""
        leader = self._node.holders.leader
        if leader is not None and leader.version in self._node.publisher.pinned_versions():
            return leader.version
        return self._node.target_version

    def replace_behind(self, behind: Child) -> None:
        """A shadow that failed to switch never stays behind: a new one starts on the target."""
        if self._node.holders.shadow is behind:
            children.stop(self._node.holders.set("shadow", None))
            self.start_if_due()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once a shadow is ready on the version the node serves."""
        node = self._node
        deadline = time.monotonic() + (timeout or node.config.engine_start_timeout_s)
        while time.monotonic() < deadline:
            with node.lock:
                shadow = node.holders.shadow
                if shadow is not None and shadow.ready is not None and shadow.version == node.target_version:
                    return True
            time.sleep(0.02)
        return False

    def state(self) -> str:
        if not self._node.config.shadow:
            return "off"
        if self.restarts.degraded:
            return "degraded"
        if self._node.holders.shadow is None:
            return "waiting"  # its backoff, or a recovery, before the next start
        return "ready" if self._node.holders.shadow.ready is not None else "starting"
