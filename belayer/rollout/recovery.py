"""Takeover and cold start (docs/design.md §3): fence the failed leader, check the owner
and the shadow, move the lease, re-send everything in flight; a cold start when the shadow
cannot serve, recorded as such and with the reason.

Runs on the node's loop thread without the node lock: submits, heartbeats and status go
on during a cold start; the loop itself is the only thread that touches children. What it
asks of the node is `RecoveringNode`, the part of `RolloutNode`'s interface that is public
for it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from belayer.rollout import children, shm
from belayer.rollout.config import RolloutConfig
from belayer.rollout.errors import RolloutError
from belayer.rollout.inflight import InFlightLog
from belayer.rollout.protocol import HealthCheck, HealthResult, SketchResult, VerifySketch

if TYPE_CHECKING:  # these modules call `recover`
    from belayer.rollout.dispatcher import Dispatcher
    from belayer.rollout.owner_role import OwnerRole
    from belayer.rollout.publish import PublishCoordinator
    from belayer.rollout.roles import Roles, ShadowRole

log = logging.getLogger("belayer.rollout")


@dataclass(frozen=True)
class RecoveryEvent:
    """One takeover or cold start, with the time of each phase (seconds)."""

    kind: str  # "takeover" | "takeover_after_wait" | "cold_start"
    reason: str
    fallback_reason: str | None
    failed_pid: int | None
    epoch: int
    ready_s: float  # failure detected → leader accepting work again (requests re-sent)
    phases: dict[str, float]
    replayed_requests: int
    replayed_tokens: int
    detected_at: float  # time.monotonic()
    ready_at: float
    waited_for_shadow_s: float = 0.0  # > 0: the shadow was not ready (or mid-switch) yet
    weights_version: int = 1  # what the new leader computes with


class RecoveringNode(Protocol):
    """What a recovery reads and does on the node (`RolloutNode`), from its loop thread:
    the shared records, and the public interfaces of the roles, the publish coordinator
    (which versions drains pin) and the dispatcher (the replay)."""

    config: RolloutConfig
    inflight: InFlightLog  # read and changed under `lock`
    recoveries: list[RecoveryEvent]  # appended under `lock`
    broken: str | None  # set under `lock`
    target_version: int
    holders: Roles
    owner_role: OwnerRole
    shadow_role: ShadowRole
    publisher: PublishCoordinator
    dispatcher: Dispatcher

    @property
    def lock(self) -> threading.RLock: ...

    def take_forced_fallback(self) -> str | None: ...

    def dispatch(self, child: children.Child, msg: Any) -> None: ...

    def notify_state(self) -> None: ...


def recover(node: RecoveringNode, reason: str) -> None:
    detected = time.monotonic()
    phases: dict[str, float] = {}
    old = node.holders.set("leader", None)
    t = time.perf_counter()
    try:
        children.fence(old)
    except RolloutError as exc:  # its lease may still be held: no other engine may lead
        _give_up(node, f"the failed leader could not be fenced: {exc}")
        return
    if old is not None:
        children.drain(old, node.dispatch)  # tokens it streamed before dying are real
    children.close_conn(old)
    with node.lock:
        node.inflight.detach_all()
    phases["fence_s"] = time.perf_counter() - t
    log.error(
        "rollout node %s: %s; recovering %d in-flight requests",
        node.config.node_id,
        reason,
        len(node.inflight),
    )

    waited = 0.0
    fallback = node.take_forced_fallback()
    if fallback is None:
        fallback = _owner_check(node, phases)
    if fallback is None:
        fallback, waited = _shadow_check(node, phases)
    kind = "takeover_after_wait" if waited > 0 else "takeover"
    if fallback is None:
        t = time.perf_counter()
        try:
            node.holders.take_lease(node.holders.shadow)
            node.holders.set("leader", node.holders.shadow)
            node.holders.set("shadow", None)
        except RolloutError as exc:
            fallback = f"shadow could not take the lease: {exc}"
        phases["lease_s"] = time.perf_counter() - t
    if fallback is not None:
        kind = "cold_start"
        log.error("rollout node %s: falling back to a cold start: %s", node.config.node_id, fallback)
        try:
            _cold_start(node, phases, owner_bad=_owner_bad(node, fallback))
        except RolloutError as exc:
            _give_up(node, f"cold start failed: {exc}")
            return
    if node.owner_role.failure is not None and node.holders.owner is not None and kind != "cold_start":
        node.owner_role.replace()  # in the background: the new owner adopts the verified segments

    with node.lock:
        records = node.inflight.open()
        for record in records:
            record.recoveries.append(kind)
            record.recovered_at.append(len(record.tokens))  # re-prefilled from here on
            if record.pinned_version is not None and record.pinned_version != node.holders.leader.version:
                record.pinned_version = None  # its version cannot be served any more: say so per token
    node.dispatcher.send_unsent()
    ready_at = time.monotonic()
    event = RecoveryEvent(
        kind=kind,
        reason=reason,
        fallback_reason=fallback,
        failed_pid=old.pid if old else None,
        epoch=node.holders.epoch,
        ready_s=ready_at - detected,
        phases=phases,
        replayed_requests=len(records),
        replayed_tokens=sum(len(r.prompt_ids) + len(r.tokens) for r in records),
        detected_at=detected,
        ready_at=ready_at,
        waited_for_shadow_s=waited,
        weights_version=node.holders.leader.version,
    )
    with node.lock:
        node.recoveries.append(event)
    log.warning(
        "rollout node %s: %s done in %.3f s (epoch %d, version %d, %d requests re-prefilled)%s",
        node.config.node_id,
        kind,
        event.ready_s,
        node.holders.epoch,
        event.weights_version,
        len(records),
        f"; cold start because {fallback}" if fallback else "",
    )
    node.shadow_role.start_if_due()  # the loop sees it ready
    node.notify_state()


def _give_up(node: RecoveringNode, why: str) -> None:
    """Nothing left to serve on: tell every request, retryable elsewhere (Temporal retries
    the activity on another node, resuming from its heartbeat)."""
    log.error("rollout node %s: %s", node.config.node_id, why)
    with node.lock:
        node.broken = why
        for record in node.inflight.open():
            node.inflight.fail(
                record, RolloutError(f"rollout node {node.config.node_id} lost its engine: {why}")
            )
    node.notify_state()


def _owner_bad(node: RecoveringNode, fallback: str) -> bool:
    return node.owner_role.failure is not None or "owner" in fallback or "full cold start" in fallback


def _owner_check(node: RecoveringNode, phases: dict[str, float]) -> str | None:
    """None when the owner's memory can back a takeover. A dead owner whose segments are
    still there does not force a cold start: the shadow's own weights are checked instead."""
    t = time.perf_counter()
    try:
        if node.owner_role.failure is not None and "checksum" in node.owner_role.failure:
            return node.owner_role.failure
        if node.holders.owner is None:
            return "memory owner is not running"
        node.owner_role.await_ready()  # a replacement adopting the segments is nearly done
        arena = node.holders.owner.ready.arena_path
        header = shm.read_arena_header(arena)
        if header.epoch != node.holders.epoch:
            return (
                f"arena epoch is {header.epoch}, expected {node.holders.epoch}: someone else wrote the lease"
            )
        if node.owner_role.failure is None:
            # what the new leader may serve: the node's version, or one a drain is pinned to
            servable = {node.target_version} | (
                node.publisher.pinned_versions() & set(node.owner_role.versions)
            )
            for version in sorted(servable):
                weights = shm.map_readonly(node.owner_role.versions[version])
                try:
                    if shm.read_weights_header(weights).status != shm.STATUS_OK:
                        return f"owner's weights version {version} is marked corrupt"
                finally:
                    weights.close()
        return None
    except (shm.SharedMemoryError, KeyError, RolloutError) as exc:
        return f"owner memory not intact: {exc}"
    finally:
        phases["owner_check_s"] = time.perf_counter() - t


def _shadow_check(node: RecoveringNode, phases: dict[str, float]) -> tuple[str | None, float]:
    """(why the shadow cannot take over, seconds spent waiting for it to be ready)."""
    t = time.perf_counter()
    waited = 0.0
    shadow = node.holders.shadow
    try:
        if shadow is None:
            return "no shadow engine configured", 0.0
        if shadow.ready is None or shadow.switching_to is not None:
            log.warning(
                "rollout node %s: shadow not ready yet (starting or switching); waiting", node.config.node_id
            )
            w = time.perf_counter()
            node.holders.await_engine(shadow)
            waited = time.perf_counter() - w
        behind = _behind(node, shadow)
        if behind is not None:
            return behind, waited
        timeout = node.config.control_timeout_s
        health = children.call(
            shadow, HealthCheck(node.holders.reference_digest), HealthResult, timeout, node.dispatch
        )
        if not health.ok:
            return f"device health check failed on the shadow (digest {health.digest[:12]})", waited
        if shadow.owner_generation != node.holders.generation or node.owner_role.failure is not None:
            # The owner it loaded from died since: its own weights must prove themselves.
            sketch = children.call(shadow, VerifySketch(), SketchResult, timeout, node.dispatch)
            phases["shadow_sketch_s"] = sketch.seconds
            if not sketch.ok:
                return "the memory owner was lost and the shadow's own weights no longer verify", waited
        return None, waited
    except RolloutError as exc:
        return f"shadow unusable: {exc}", waited
    finally:
        phases["shadow_check_s"] = time.perf_counter() - t


def _behind(node: RecoveringNode, shadow: children.Child) -> str | None:
    """A shadow serves only the version the node serves, or the one in-flight requests are
    pinned to while a finish-on-old publish drains: never a mix. One that failed a switch
    never serves (it is replaced on the loop's next iteration): the failure may have left
    its weights half replaced, whatever version it still reports."""
    if shadow.switch_failed:
        return f"shadow failed to switch weights (it reports version {shadow.version}); its weights are not trusted"
    allowed = {node.target_version} | node.publisher.pinned_versions()
    if shadow.version not in allowed:
        return f"shadow computes with weights version {shadow.version}, the node serves {sorted(allowed)}"
    return None


def _cold_start(node: RecoveringNode, phases: dict[str, float], owner_bad: bool) -> None:
    t = time.perf_counter()
    if node.holders.shadow is not None:
        children.stop(node.holders.set("shadow", None))
    if owner_bad or node.holders.owner is None or not node.holders.owner.process.is_alive():
        node.owner_role.replace(wait=True)
    phases["owner_restart_s"] = time.perf_counter() - t
    t = time.perf_counter()
    engine = node.holders.spawn_engine("cold")
    try:
        node.holders.await_engine(engine)
        node.holders.take_lease(engine)
    except RolloutError:
        children.fence(engine)
        raise
    node.holders.set("leader", engine)
    phases["engine_start_s"] = time.perf_counter() - t
