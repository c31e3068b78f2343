"""The memory owner's role in a node: keeping one alive and knowing what it holds.

The owner process (`owner.py`) keeps the weights segments and the KV arena; `OwnerRole`
is the node's side of it. It replaces a dead owner after its backoff with one that adopts
the verified segments, restores from the weight source a published version the new owner
had to reject, and records how long the node went unprotected meanwhile. Its state lives
here, not in the node, so recovery, publishing and the status read one account of which
versions the owner holds and whether it can be trusted. Loop thread only, except where a
method says otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from belayer.rollout import children, recovery, shm
from belayer.rollout.children import Child
from belayer.rollout.errors import RolloutError
from belayer.rollout.protocol import OwnerReady, VerifyWeights, WeightsVerified
from belayer.rollout.restarts import Restarts
from belayer.rollout.status import OwnerRecovery

if TYPE_CHECKING:
    from belayer.rollout.node import RolloutNode

log = logging.getLogger("belayer.rollout")


class OwnerRole:
    """The node's memory owner: its replacements, its versions, its failures."""

    def __init__(self, node: RolloutNode):
        self._node = node
        self.restarts = Restarts(
            "memory owner",
            "the engines serve from their own mappings; no takeover or publish until it starts",
        )
        self.versions: dict[int, Path] = {}  # sealed weights versions -> their segments
        self.failure: str | None = None  # why the owner cannot be trusted now
        self.restoring: int | None = None  # a lost version being staged again from the source
        self.restore_failure: str | None = None
        self.last_recovery: OwnerRecovery | None = None
        self._arena_path: Path | None = None  # the last ready owner's arena, for its successor to adopt
        self._dead: Child | None = None  # its death handled, its replacement not started yet
        # owner death -> protected again (the next leader failure is a takeover once more)
        self._lost: tuple[float, str] | None = None

    def awaiting_replacement(self, child: Child) -> bool:
        """A dead owner waiting for its backoff is not watched: its sentinel stays ready."""
        return child is self._dead

    def watch(self, ready: list) -> None:
        """(loop) Handle the owner's death if its sentinel fired; replace it once due."""
        owner = self._node.holders.owner
        if owner is not None and owner.process.sentinel in ready and owner is not self._dead:
            self._dead = owner
            self._on_death()
        self._replace_dead_if_due()

    def _on_death(self) -> None:
        node = self._node
        owner = node.holders.owner
        owner.process.join(children.REAP_TIMEOUT_S)  # dead (its sentinel fired): reap it for its exit code
        self.failure = f"memory owner (pid {owner.pid}) exited with {owner.process.exitcode}" + (
            "" if owner.ready else " while starting"
        )
        self._lost = self._lost or (time.monotonic(), self.failure)
        delay = self.restarts.died(self.failure)
        log.error(
            "rollout node %s: %s; a replacement adopts its verified segments in %.0f s",
            node.config.node_id,
            self.failure,
            delay,
        )
        if self.restarts.degraded:
            log.error("rollout node %s: degraded: %s", node.config.node_id, self.restarts.degraded)
        node.publisher.fail_owner_requests(RolloutError(f"{self.failure} during the publish; publish again"))
        node.notify_state()

    def _replace_dead_if_due(self) -> None:
        owner = self._node.holders.owner
        if owner is not None and not owner.process.is_alive() and self.restarts.due():
            self.replace()  # a staged, unsealed segment is not adopted

    def replace(self, wait: bool = False) -> None:
        """Start an owner that adopts the current one's sealed segments and arena (verifying
        every tensor) or, for a new node, loads the weights from disk."""
        node = self._node
        old = node.holders.owner
        adopt: dict[str, Any] = {"current_version": node.target_version}
        if self.versions:  # the last ready owner's sealed segments and arena
            adopt["adopt_weights"] = dict(self.versions)
            adopt["adopt_arena"] = self._arena_path
        if old is not None:
            children.fence(old)  # not Stop: a stopping owner unlinks the segments being adopted
            children.close_conn(old)
        self.restarts.started()
        node.holders.generation += 1
        owner = children.spawn_owner(node.config, node.model_dir, node.holders.generation, **adopt)
        node.holders.set("owner", owner)
        if wait:
            self.await_ready()

    def await_ready(self) -> None:
        owner = self._node.holders.owner
        if owner.ready is None:
            children.await_ready(owner, self._node.config.engine_start_timeout_s, self._node.dispatch)
            self.on_ready(owner.ready)

    def on_ready(self, ready: OwnerReady) -> None:
        """(node lock held, or before the loop) The owner adopted or built its segments."""
        node = self._node
        self.failure = None
        self.restarts.ready()
        self._arena_path = ready.arena_path
        self.versions = dict(ready.versions)
        self._check_rejected(ready.rejected)
        keep = {*ready.versions.values(), ready.arena_path}
        mapped = {c.spec.arena_path for c in (node.holders.leader, node.holders.shadow) if c is not None}
        for path in shm.leftover_segments(node.config.node_id):
            if path not in keep and path not in mapped:
                path.unlink(missing_ok=True)  # a predecessor's staged or dropped segment

    def on_checksum_mismatch(self, msg: WeightsVerified) -> None:
        """(node lock held) The owner found a tensor that no longer verifies: cold start."""
        node = self._node
        versions = ", ".join(str(v) for v in msg.bad_versions)
        self.failure = f"weights checksum mismatch in weights version {versions}: {list(msg.bad_tensors)[:3]}"
        log.error("rollout node %s: %s", node.config.node_id, self.failure)
        node.in_loop(lambda: recovery.recover(node, self.failure) if node.holders.leader else None)

    def _check_rejected(self, rejected: tuple[int, ...]) -> None:
        """A segment the new owner would not adopt failed verification. Version 1 it rebuilt
        from the model files; a published version is staged again from the weight source.
        Engines that read it in place (shared) computed with bad bytes, so the leader is
        replaced (the shadow must prove its own weights by sketch, or it is a cold start)
        once the owner holds the version again. Private engines computed from their own
        copies, made when the segment still verified."""
        if not rejected:
            return
        node = self._node
        log.error(
            "rollout node %s: the new owner rejected weights version(s) %s (failed verification)",
            node.config.node_id,
            list(rejected),
        )
        in_use = node.holders.engine_versions() & set(rejected)
        why = f"weights version(s) {sorted(in_use)} the engines read failed verification"
        replace_leader = (
            node.config.weight_mode == "shared" and bool(in_use) and node.holders.leader is not None
        )
        if node.target_version in self.versions:
            if replace_leader:
                node.in_loop(lambda: recovery.recover(node, why) if node.holders.leader else None)
            return
        self.restoring, self.restore_failure = node.target_version, None
        threading.Thread(
            target=self._restore_lost_version,
            args=(node.target_version, why if replace_leader else None),
            name=f"belayer-{node.config.node_id}-restore",
            daemon=True,
        ).start()

    def _restore_lost_version(self, version: int, then_recover: str | None) -> None:
        """Stage, write and seal `version` again from the weight source (off the loop)."""
        node = self._node
        timeout = node.config.publish_timeout_s
        try:
            tensors = node.weight_source(version) if node.weight_source is not None else None
            if tensors is None:
                raise RolloutError(
                    f"weights version {version} was lost with the memory owner and no weight "
                    "source holds it; publish it again"
                )
            node.publisher.stage_write_seal(version, tensors, timeout)
            log.warning(
                "rollout node %s: weights version %d staged again from its source",
                node.config.node_id,
                version,
            )
            if then_recover:
                node.in_loop(lambda: recovery.recover(node, then_recover) if node.holders.leader else None)
        except Exception as exc:  # the node goes on serving from the engines' own memory
            self.restore_failure = f"could not restore weights version {version}: {exc}"
            log.error("rollout node %s: %s", node.config.node_id, self.restore_failure)
        finally:
            self.restoring = None
            node.wake()

    def verify_weights(self) -> WeightsVerified:
        """(loop) Have the owner re-hash every tensor now; a mismatch is handled as one
        found by the owner's own periodic check."""
        node = self._node
        owner = node.holders.owner
        result = children.call(
            owner, VerifyWeights(), WeightsVerified, node.config.control_timeout_s + 60, node.dispatch
        )
        if not result.ok:
            node.dispatch(owner, result)
        return result

    def state(self) -> str:
        owner = self._node.holders.owner
        if owner is None:
            return "none"
        if self.restarts.degraded:
            return "degraded"
        if not owner.process.is_alive():
            return "waiting"  # its backoff before the next start
        if owner.ready is None or self.failure is not None:
            return "re-adopting"
        if self._node.target_version not in self.versions:
            return "restoring" if self.restoring is not None else "missing the served version"
        return "alive"

    def note_protected_again(self) -> None:
        """(loop) Once the node is protected after its owner died, record how long that took."""
        node = self._node
        if self._lost is None or not node.protected():
            return
        lost_at, reason = self._lost
        self._lost = None
        self.last_recovery = OwnerRecovery(
            reason=reason,
            protected_again_s=round(time.monotonic() - lost_at, 3),
            owner_generation=node.holders.generation,
        )
        log.warning(
            "rollout node %s: protected again %.2f s after %s",
            node.config.node_id,
            self.last_recovery.protected_again_s,
            reason,
        )
        node.notify_state()
