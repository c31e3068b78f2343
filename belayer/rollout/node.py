"""The rollout node: one node's memory owner, leader engine and shadow engine.

`RolloutNode` is the API other threads use (submit, cancel, publish, status) and the
composition of the parts that do the work, each in its own module with the interface
the others (and a recovery) use:

- `roles.Roles`: who holds owner, leader and shadow, the lease epoch, starting engines;
- `owner_role.OwnerRole`: replacing a dead owner, the versions it holds, restoring one;
- `roles.ShadowRole`: keeping a shadow ready on the right version;
- `publish.PublishCoordinator`: stage, write, seal, switch, the finish_on_old pins;
- `dispatcher.Dispatcher`: requests to the leader through the in-flight log, tokens back;
- `recovery`: takeover and cold start.

The node owns what they share: the lock, the in-flight log, the version it serves, the
recoveries so far, and the one loop thread that owns the children: it alone talks to
their pipes, forwards logged requests to the leader (which batches them continuously),
collects token deltas and watches for failures: a dead leader is seen at once (process
sentinel), a hung one by missed heartbeats. The node lock guards only shared records and
is never held through a cold start or a publish, so submits, heartbeats and status go on
meanwhile.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from belayer.rollout import children, recovery, shm
from belayer.rollout.admission import Capacity
from belayer.rollout.children import Child
from belayer.rollout.config import RolloutConfig
from belayer.rollout.dispatcher import Dispatcher, RequestHandle
from belayer.rollout.errors import NodeClosedError, RolloutError
from belayer.rollout.hang import Deadlines, HangDeadline
from belayer.rollout.inflight import Completion, InFlightLog
from belayer.rollout.owner_role import OwnerRole
from belayer.rollout.procutil import memory_of
from belayer.rollout.protocol import (
    EngineReady,
    Failed,
    OwnerReady,
    Rejected,
    SamplingSpec,
    Sealed,
    SealRefused,
    Staged,
    StepOutput,
    SwitchFailed,
    WeightsSwitched,
    WeightsVerified,
)
from belayer.rollout.publish import PublishCoordinator, PublishReport
from belayer.rollout.recovery import RecoveryEvent
from belayer.rollout.roles import Roles, ShadowRole
from belayer.rollout.status import Load, NodeStatus, RecoverySummary, rounded

__all__ = ["Completion", "NodeStatus", "PublishReport", "RecoveryEvent", "RequestHandle", "RolloutNode"]

log = logging.getLogger("belayer.rollout")
# How often the roles are published even when no role changed (the hang deadline moves).
STATE_REFRESH_S = 5.0


class RolloutNode:
    """Owner + leader + shadow of one node. `start()`, `submit()`, `publish()`, `close()`."""

    def __init__(
        self,
        config: RolloutConfig,
        model_dir: Path,
        weight_source: Callable[[int], Mapping[str, Any] | None] | None = None,
    ):
        """`weight_source(version)` gives a published version's tensors from where its
        publisher keeps them (None if it does not hold it): what a new owner cannot adopt
        because it failed verification is staged again from there."""
        self.config = config
        self.model_dir = Path(model_dir)
        self.weight_source = weight_source
        self.vocab_size = _vocab_size(self.model_dir)
        self.capacity = Capacity.of(config, self.model_dir)  # what it admits (belayer/rollout/admission.py)
        self.refused = 0  # requests refused for want of capacity since the node started
        self._lock = threading.RLock()
        self.inflight = InFlightLog()
        self.recoveries: list[RecoveryEvent] = []
        self.hang = HangDeadline(config.heartbeat_timeout_s, config.heartbeat_interval_s, config.hang_floor_s)
        self.target_version = 1  # what the engines compute with once any publish settles
        self.broken: str | None = None  # set when no engine could be started: the node refuses work
        self.holders = Roles(self)
        self.owner_role = OwnerRole(self)
        self.shadow_role = ShadowRole(self)
        self.publisher = PublishCoordinator(self)
        self.dispatcher = Dispatcher(self)
        self._state_published_at = 0.0
        self._pending: list[tuple[Callable[[], Any], Future]] = []
        self._forced_fallback: str | None = None
        self._state_listeners: list[Callable[[NodeStatus], None]] = []
        self._wake_r, self._wake_w = children.MP.Pipe(duplex=False)
        self._closed = threading.Event()
        self._loop: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, wait_shadow: bool = True) -> RolloutNode:
        """Owner, then primary (leader), then shadow; returns when the leader serves."""
        stale = shm.unlink_segments(self.config.node_id)
        if stale:
            log.warning("removed stale shared memory of node %s: %s", self.config.node_id, stale)
        try:
            self.owner_role.replace(wait=True)
            self.target_version = self.holders.owner.ready.current_version
            leader = self.holders.spawn_engine("primary")
            self.holders.await_engine(leader)
            self.holders.reference_digest = leader.ready.device_digest
            self.holders.take_lease(leader)
            self.holders.set("leader", leader)
            self.shadow_role.start_if_due()
            if self.holders.shadow is not None and wait_shadow:
                self.shadow_role.await_first()
        except BaseException:
            self.close()
            raise
        self._loop = threading.Thread(
            target=self._run_loop, name=f"belayer-{self.config.node_id}-loop", daemon=True
        )
        self._loop.start()
        return self

    def close(self) -> None:
        """Stop every child, unlink the node's shared memory; fail requests still in flight."""
        self._closed.set()
        self.wake()
        if self._loop is not None and self._loop is not threading.current_thread():
            self._loop.join(timeout=10)
        with self._lock:
            for child in (self.holders.shadow, self.holders.leader, self.holders.owner):
                if child is not None:
                    try:
                        children.stop(child)
                    except RolloutError as exc:  # stop the others all the same
                        log.error("rollout node %s: closing: %s", self.config.node_id, exc)
            self.holders.shadow = self.holders.leader = self.holders.owner = None
            for record in self.inflight.open():
                self.inflight.fail(record, NodeClosedError(f"rollout node {self.config.node_id} closed"))
            self.publisher.fail(NodeClosedError(f"rollout node {self.config.node_id} closed"))
        shm.unlink_segments(self.config.node_id)

    def __enter__(self) -> RolloutNode:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def pids(self) -> dict[str, int]:
        return self.holders.pids()

    def wait_shadow_ready(self, timeout: float | None = None) -> bool:
        """True once a shadow is ready on the version the node serves."""
        return self.shadow_role.wait_ready(timeout)

    # -- requests (the dispatcher) --------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        spec: SamplingSpec,
        request_id: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> RequestHandle:
        """Validate and log one request; the loop sends it to the leader. Bad input raises
        `BadRequestError` (non-retryable) and leaves the node serving."""
        return self.dispatcher.submit(prompt_ids, spec, request_id, on_progress)

    def has_room(self) -> bool:
        """Whether the node would admit one more request now (read without its lock: a
        hint for whoever decides to send one; `submit` itself decides under the lock)."""
        return self.broken is None and len(self.inflight) < self.capacity.sequences

    def cancel(self, request_id: str, why: str = "cancelled by the caller") -> None:
        """Drop a request (e.g. its activity was cancelled): the leader stops decoding it."""
        self.dispatcher.cancel(request_id, why)

    def generate(self, prompt_ids: list[int], spec: SamplingSpec, timeout: float | None = None) -> Completion:
        return self.submit(prompt_ids, spec).result(timeout)

    def add_progress_listener(self, listener: Callable[[str, int], None]) -> None:
        """Call `listener(request_id, tokens_so_far)` on the loop thread after every delta
        (benchmarks and fault injection: act at an exact point of progress)."""
        self.dispatcher.add_progress_listener(listener)

    def remove_progress_listener(self, listener: Callable[[str, int], None]) -> None:
        self.dispatcher.remove_progress_listener(listener)

    # -- publishing (the publish coordinator) ---------------------------------------------

    def publish(
        self,
        version: int,
        tensors: Mapping[str, Any],
        policy: str | None = None,
        timeout: float | None = None,
    ) -> PublishReport:
        """Make `version` (the model's full state dict, HF or vLLM names) what both engines
        compute with, in place; returns once both serve it. See `publish` for the steps and
        the in-flight policies (default `rollout.publish_policy`)."""
        return self.publisher.publish(version, tensors, policy, timeout)

    def release_weights(self, version: int) -> None:
        """The trainer no longer needs `version`: the owner drops it unless an engine or an
        in-flight request still uses it (then it goes with the next publish)."""
        self.publisher.release_weights(version)

    def verify_weights(self) -> WeightsVerified:
        """Ask the owner to re-hash every tensor now; a mismatch triggers a cold start."""
        return self.in_loop(self.owner_role.verify_weights).result(self.config.control_timeout_s + 60)

    # -- status ---------------------------------------------------------------------------

    def add_state_listener(self, listener: Callable[[NodeStatus], None]) -> None:
        """Call `listener(self.roles())` now and whenever a role, the epoch, a weights
        version or the recovery count changes (the node worker publishes it for `belayer chaos`)."""
        with self._lock:
            self._state_listeners.append(listener)
            listener(self.roles())

    def remove_state_listener(self, listener: Callable[[NodeStatus], None]) -> None:
        with self._lock:
            self._state_listeners.remove(listener)

    def roles(self) -> NodeStatus:
        """Pids by role, lease epoch, weights versions, recoveries so far and the last one."""
        with self._lock:
            owner, leader, shadow = self.holders.owner, self.holders.leader, self.holders.shadow
            publishing = self.publisher.publishing
            return NodeStatus(
                node_id=self.config.node_id,
                owner=owner.pid if owner else None,
                leader=leader.pid if leader else None,
                shadow=shadow.pid if shadow else None,
                shadow_ready=bool(shadow and shadow.ready),
                epoch=self.holders.epoch,
                generation=self.holders.generation,
                weight_mode=self.config.weight_mode,
                weights_version=self.target_version,
                leader_version=leader.version if leader else None,
                shadow_version=shadow.version if shadow and shadow.ready else None,
                weights_versions_held=tuple(sorted(self.owner_role.versions)),
                publishing=publishing.version if publishing else None,
                recoveries=len(self.recoveries),
                broken=self.broken,
                owner_state=self.owner_role.state(),
                shadow_state=self.shadow_role.state(),
                degraded=self._degraded(),
                protected=self.protected(),
                hang_deadline=rounded(self.hang_deadlines()),
                last_owner_recovery=self.owner_role.last_recovery,
                last_recovery=RecoverySummary.of(self.recoveries[-1]) if self.recoveries else None,
                capacity=Load(
                    self.capacity.sequences, self.capacity.kv_tokens, len(self.inflight.open()), self.refused
                ),
            )

    def _degraded(self) -> str | None:
        restarts = (self.owner_role.restarts, self.shadow_role.restarts)
        restore_failure = self.owner_role.restore_failure
        return (
            "; ".join(
                [r.degraded for r in restarts if r.degraded] + ([restore_failure] if restore_failure else [])
            )
            or None
        )

    def protected(self) -> bool:
        """A leader failure now would be a takeover: owner verified and alive, shadow ready
        on the version the node serves (or no shadow wanted)."""
        if self.holders.leader is None or self.owner_role.state() != "alive":
            return False
        if not self.config.shadow:
            return True
        shadow = self.holders.shadow
        return (
            shadow is not None
            and shadow.ready is not None
            and shadow.version == self.target_version
            and not shadow.switch_failed
        )

    def force_full_cold_start_next(self, why: str) -> None:
        """Make the next recovery a full cold start (new owner, new engine)."""
        with self._lock:
            self._forced_fallback = f"full cold start requested: {why}"

    def take_forced_fallback(self) -> str | None:
        """Why `force_full_cold_start_next` asked for a cold start, handed out once: to the
        recovery that does it."""
        with self._lock:
            fallback, self._forced_fallback = self._forced_fallback, None
        return fallback

    @property
    def lock(self) -> threading.RLock:
        """The node lock (reentrant), held by whoever reads or changes the in-flight log,
        `recoveries` or `broken` outside the node's own methods: a recovery does."""
        return self._lock

    def memory(self) -> dict[str, tuple[int, int, int]]:
        """(rss, private, shared) bytes per child process, by role."""
        out = {}
        for role, pid in self.pids().items():
            try:
                out[role] = memory_of(pid)
            except OSError:
                pass
        return out

    # -- the loop -------------------------------------------------------------------------

    def _run_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._loop_once()
            except Exception:  # the loop must outlive any single bad message
                log.exception("rollout node %s: loop error", self.config.node_id)
                time.sleep(0.05)

    def _loop_once(self) -> None:
        holders = self.holders
        watched = [
            c
            for c in (holders.leader, holders.shadow, holders.owner)
            if c is not None and not self.owner_role.awaiting_replacement(c)
        ]
        waitables: list[Any] = [self._wake_r]
        for c in watched:
            waitables += [c.conn, c.process.sentinel]
        ready = wait(waitables, timeout=min(self.config.heartbeat_interval_s, 0.1))
        if self._wake_r in ready:
            while self._wake_r.poll(0):
                self._wake_r.recv()
        self._run_pending()
        for child in watched:
            if child.conn in ready:
                children.drain(child, self.dispatch)  # dispatch takes the node lock itself
        if self._closed.is_set():
            return
        self.owner_role.watch(ready)
        if holders.shadow is not None and holders.shadow.process.sentinel in ready:
            self.shadow_role.on_death()
        failure = self._leader_failure(ready)
        if failure is not None:
            recovery.recover(self, failure)
        self.shadow_role.start_if_due()
        self.publisher.advance()
        self.dispatcher.send_unsent()
        self.owner_role.note_protected_again()
        if time.monotonic() - self._state_published_at > STATE_REFRESH_S:
            self.notify_state()  # the hang deadline moves with every step

    def _leader_failure(self, ready: list) -> str | None:
        leader = self.holders.leader
        if leader is None:
            return None
        if leader.process.sentinel in ready:
            leader.process.join()  # already dead: reap it so the exit code is known
            return f"leader (pid {leader.pid}) died with exit code {leader.process.exitcode}"
        # A weights switch is a pause like an engine start: it does not heartbeat meanwhile.
        if leader.switching_to is not None:
            limit = max(self.config.heartbeat_timeout_s, self.config.engine_start_timeout_s)
        else:
            limit = self.hang_deadlines().current_s
        if time.monotonic() - leader.last_heard > limit:
            return (
                f"leader (pid {leader.pid}) missed heartbeats: silent for {limit:.1f} s, the hang deadline "
                f"derived from its step times (at most rollout.heartbeat_timeout_s = "
                f"{self.config.heartbeat_timeout_s} s)"
            )
        return None

    def hang_deadlines(self) -> Deadlines:
        with self._lock:  # submits add records from other threads, status reads from any
            return self.hang.deadlines({r.engine_request_id for r in self.inflight.on_leader()})

    def dispatch(self, child: Child, msg: Any) -> None:
        """Handle one message from a child (under the node lock: it may touch the records,
        and control calls during a recovery dispatch from the loop without holding it)."""
        with self._lock:
            child.last_heard = time.monotonic()
            if isinstance(msg, StepOutput):  # only a leader steps; a fenced one's last tokens are real
                self.hang.stepped(msg.step_s, msg.prefilled_tokens, [d.engine_request_id for d in msg.deltas])
                self.dispatcher.on_step(msg)
            elif isinstance(msg, Rejected):
                self.dispatcher.on_rejected(msg)
            elif isinstance(msg, (EngineReady, OwnerReady)):
                children.on_ready(child, msg)
                if isinstance(msg, OwnerReady):
                    self.owner_role.on_ready(msg)
                else:
                    if child is self.holders.shadow:
                        self.shadow_role.restarts.ready()
                    log.info(
                        "rollout node %s: %s engine (pid %s) ready in %.2f s",
                        self.config.node_id,
                        child.role,
                        msg.pid,
                        msg.init_s,
                    )
                self.notify_state()
            elif isinstance(msg, (WeightsSwitched, SwitchFailed)):
                self.publisher.on_switched(child, msg)
            elif isinstance(msg, (Staged, Sealed, SealRefused)) and child is self.holders.owner:
                self.publisher.on_owner_reply(msg)
            elif isinstance(msg, WeightsVerified) and child is self.holders.owner and not msg.ok:
                self.owner_role.on_checksum_mismatch(msg)
            elif isinstance(msg, Failed):
                log.error("rollout node %s: %s reported: %s", self.config.node_id, child.role, msg.message)

    def in_loop(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the loop thread (the only one that talks to children), outside the
        node lock; from the loop itself it runs at the start of the next iteration."""
        future: Future = Future()
        if self._loop is None:  # not started yet (or never): nothing else touches children
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            return future
        with self._lock:
            self._pending.append((fn, future))
        self.wake()
        return future

    def _run_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fn, future in pending:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def wake(self) -> None:
        """Make the loop run its next iteration now (new work, or `in_loop`)."""
        try:
            self._wake_w.send(None)
        except OSError:
            pass

    def notify_state(self) -> None:
        self._state_published_at = time.monotonic()
        if not self._state_listeners:
            return
        state = self.roles()
        for listener in list(self._state_listeners):
            try:
                listener(state)
            except Exception:  # a publisher must never break the node
                log.exception("rollout node %s: state listener failed", self.config.node_id)


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
