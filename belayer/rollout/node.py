"""The rollout node: one node's memory owner, leader engine and shadow engine.

`RolloutNode` is the API other threads use (submit, cancel, publish, status). A single
loop thread owns the children: it alone talks to their pipes, forwards logged requests to
the leader (which batches them continuously), collects token deltas and watches for
failures: a dead leader is seen at once (process sentinel), a hung one by missed
heartbeats. The protocols live in their own modules: the in-flight log (`inflight`),
takeover and cold start (`recovery`), publishing weights in place (`publish`), the
children (`children`). The node lock guards only shared records and is never held through
a cold start or a publish, so submits, heartbeats and status go on meanwhile.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from belayer.rollout import children, recovery, shm
from belayer.rollout.children import Child
from belayer.rollout.config import RolloutConfig
from belayer.rollout.errors import BadRequestError, EngineStartError, NodeClosedError, RolloutError
from belayer.rollout.hang import Deadlines, HangDeadline
from belayer.rollout.inflight import Completion, InFlight, InFlightLog, completion, new_record
from belayer.rollout.procutil import memory_of
from belayer.rollout.protocol import (
    AbortRequest,
    DropWeights,
    EngineReady,
    Failed,
    LeaseTaken,
    OwnerReady,
    Rejected,
    SamplingSpec,
    Sealed,
    SealRefused,
    SealWeights,
    Staged,
    StageWeights,
    StepOutput,
    SwitchFailed,
    SwitchWeights,
    TakeLease,
    UnstageWeights,
    VerifyWeights,
    WeightsSwitched,
    WeightsVerified,
)
from belayer.rollout.publish import (
    Publish,
    PublishRefusedError,
    PublishReport,
    check_policy,
    write_staged,
)
from belayer.rollout.recovery import RecoveryEvent
from belayer.rollout.restarts import Restarts

__all__ = ["Completion", "PublishReport", "RecoveryEvent", "RequestHandle", "RolloutNode"]

log = logging.getLogger("belayer.rollout")
# How often the roles are published even when no role changed (the hang deadline moves).
STATE_REFRESH_S = 5.0


class RequestHandle:
    """A submitted request: wait for its `Completion`, or look at its progress."""

    def __init__(self, node: RolloutNode, record: InFlight):
        self._node, self._record = node, record

    @property
    def request_id(self) -> str:
        return self._record.request_id

    # Lock-free on purpose: heartbeats must never wait for the node. The lists only grow
    # (loop thread, logprobs and versions before tokens) and copying one is atomic under
    # the GIL, so each is a consistent prefix of the request's output.
    def tokens_so_far(self) -> list[int]:
        return list(self._record.tokens)

    def logprobs_so_far(self) -> list[float]:
        return list(self._record.logprobs)

    def versions_so_far(self) -> list[int]:
        return list(self._record.versions)

    def done(self) -> bool:
        return self._record.done.is_set()

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` from the node's thread when the request ends (now if it has)."""
        self._record.when_done(callback)

    def result(self, timeout: float | None = None) -> Completion:
        if not self._record.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self._record.error is not None:
            raise self._record.error
        return completion(self._record, self._node._decode)


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
        self.restoring: int | None = None  # a lost version being staged again from the source
        self.restore_failure: str | None = None
        self._lock = threading.RLock()
        self.inflight = InFlightLog()
        self.recoveries: list[RecoveryEvent] = []
        self.hang = HangDeadline(config.heartbeat_timeout_s, config.heartbeat_interval_s, config.hang_floor_s)
        self.shadow_restarts = Restarts(
            "shadow", "serving with the leader alone (a leader failure means a cold start)"
        )
        self.owner_restarts = Restarts(
            "memory owner",
            "the engines serve from their own mappings; no takeover or publish until it starts",
        )
        self._arena_path: Path | None = None  # the last ready owner's arena, for its successor to adopt
        self._dead_owner: Child | None = None  # its death handled, its replacement not started yet
        # owner death -> protected again (the next leader failure is a takeover once more)
        self._owner_lost: tuple[float, str] | None = None
        self.last_owner_recovery: dict | None = None
        self._state_published_at = 0.0
        self.owner: Child | None = None
        self.leader: Child | None = None
        self.shadow: Child | None = None
        self.generation = 0
        self.epoch = 0
        self.reference_digest: str | None = None
        self.owner_failure: str | None = None
        self.owner_versions: dict[int, Path] = {}
        self.target_version = 1  # what the engines compute with once any publish settles
        self.publishing: Publish | None = None
        # (request id, version) -> the future its reply resolves: see `_owner_request`
        self._owner_replies: dict[tuple[int, int], Future] = {}
        self._owner_request_ids = itertools.count(1)
        self._pending: list[tuple[Callable[[], Any], Future]] = []
        self._forced_fallback: str | None = None
        self._listeners: list[Callable[[str, int], None]] = []
        self._state_listeners: list[Callable[[dict], None]] = []
        self.broken: str | None = None  # set when no engine could be started: the node refuses work
        self._wake_r, self._wake_w = children.MP.Pipe(duplex=False)
        self._closed = threading.Event()
        self._loop: threading.Thread | None = None
        self._tokenizer = None
        self.vocab_size = _vocab_size(self.model_dir)

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, wait_shadow: bool = True) -> RolloutNode:
        """Owner, then primary (leader), then shadow; returns when the leader serves."""
        stale = shm.unlink_segments(self.config.node_id)
        if stale:
            log.warning("removed stale shared memory of node %s: %s", self.config.node_id, stale)
        try:
            self.replace_owner(wait=True)
            self.target_version = self.owner.ready.current_version
            leader = self.spawn_engine("primary")
            self.await_engine(leader)
            self.reference_digest = leader.ready.device_digest
            self.take_lease(leader)
            self.set_role("leader", leader)
            self.start_shadow_if_due()
            if self.shadow is not None and wait_shadow:
                self._await_start_shadow()
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
        self._wake()
        if self._loop is not None and self._loop is not threading.current_thread():
            self._loop.join(timeout=10)
        with self._lock:
            for child in (self.shadow, self.leader, self.owner):
                if child is not None:
                    try:
                        children.stop(child)
                    except RolloutError as exc:  # stop the others all the same
                        log.error("rollout node %s: closing: %s", self.config.node_id, exc)
            self.shadow = self.leader = self.owner = None
            for record in self.inflight.open():
                self.inflight.fail(record, NodeClosedError(f"rollout node {self.config.node_id} closed"))
            if self.publishing is not None and not self.publishing.done.done():
                self.publishing.done.set_exception(
                    NodeClosedError(f"rollout node {self.config.node_id} closed")
                )
        shm.unlink_segments(self.config.node_id)

    def __enter__(self) -> RolloutNode:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {
                c.role if c is not self.leader else "leader": c.pid
                for c in (self.owner, self.leader, self.shadow)
                if c
            }

    def wait_shadow_ready(self, timeout: float | None = None) -> bool:
        """True once a shadow is ready on the version the node serves."""
        deadline = time.monotonic() + (timeout or self.config.engine_start_timeout_s)
        while time.monotonic() < deadline:
            with self._lock:
                shadow = self.shadow
                if shadow is not None and shadow.ready is not None and shadow.version == self.target_version:
                    return True
            time.sleep(0.02)
        return False

    # -- requests -----------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        spec: SamplingSpec,
        request_id: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> RequestHandle:
        """Validate and log one request; the loop sends it to the leader. Bad input raises
        `BadRequestError` (non-retryable) and leaves the node serving."""
        self._validate(prompt_ids, spec)
        if self._closed.is_set():
            raise NodeClosedError(f"rollout node {self.config.node_id} is closed")
        if self.broken is not None:
            raise RolloutError(
                f"rollout node {self.config.node_id} cannot serve ({self.broken}); retry elsewhere"
            )
        record = new_record(prompt_ids, spec, request_id or uuid.uuid4().hex, on_progress)
        with self._lock:
            if self.inflight.get(record.request_id) is not None:
                raise BadRequestError(f"request id {record.request_id} is already in flight")
            self.inflight.add(record)
            log.debug("request %s: %d prompt tokens, %s", record.request_id, len(record.prompt_ids), spec)
        self._wake()
        return RequestHandle(self, record)

    def cancel(self, request_id: str, why: str = "cancelled by the caller") -> None:
        """Drop a request (e.g. its activity was cancelled): the leader stops decoding it."""
        with self._lock:
            record = self.inflight.get(request_id)
            if record is None:
                return
            engine_id = record.engine_request_id
            self.inflight.fail(record, NodeClosedError(f"request {request_id}: {why}"))
        if engine_id is not None:
            self._in_loop(lambda: children.send(self.leader, AbortRequest(engine_id)))

    def generate(self, prompt_ids: list[int], spec: SamplingSpec, timeout: float | None = None) -> Completion:
        return self.submit(prompt_ids, spec).result(timeout)

    # -- publishing ---------------------------------------------------------------------

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
        policy = check_policy(policy or self.config.publish_policy)
        timeout = timeout or self.config.publish_timeout_s
        pub = self._begin_publish(version, policy)
        try:
            path = self._stage_write_seal(version, tensors, timeout, pub)
            self._in_loop(lambda: self._switch_to(pub, version, path)).result(timeout)
            pub.done.result(timeout)
            return pub.report()
        except FutureTimeout:
            raise RolloutError(
                f"publish of weights version {version} not done after {timeout} s (rollout.publish_timeout_s)"
            ) from None
        finally:
            with self._lock:
                if self.publishing is pub:
                    self.publishing = None

    def release_weights(self, version: int) -> None:
        """The trainer no longer needs `version`: the owner drops it unless an engine or an
        in-flight request still uses it (then it goes with the next publish)."""
        self._in_loop(lambda: self._drop_unused(keep=set(self.owner_versions) - {version})).result(
            self.config.control_timeout_s
        )

    def _begin_publish(self, version: int, policy: str) -> Publish:
        with self._lock:
            if self.broken is not None:
                raise RolloutError(f"rollout node {self.config.node_id} cannot serve ({self.broken})")
            if self.restoring is not None:
                raise RolloutError(
                    f"weights version {self.restoring} is being restored after the memory owner "
                    "was replaced; publish again shortly"
                )
            if self.publishing is not None:
                raise BadRequestError(
                    f"weights version {self.publishing.version} is still being published; "
                    "publish one at a time"
                )
            newest = max([self.target_version, *self.owner_versions])
            if version <= newest:
                raise BadRequestError(
                    f"weights version {version} is not newer than {newest}; versions only grow"
                )
            self.publishing = Publish(version, self.target_version, policy, time.perf_counter())
            return self.publishing

    def _stage_write_seal(
        self, version: int, tensors: Mapping[str, Any], timeout: float, pub: Publish | None = None
    ) -> Path:
        """Have the owner stage `version`, write `tensors` into its segment and have the owner
        seal it; returns the segment. Any failure on the way (a write that raises, an owner
        that does not answer in time) unstages the version, so it can be published again at
        once instead of existing half-made on the owner until the owner is replaced."""
        mark = pub.mark if pub is not None else lambda phase: None
        try:
            staged = self._owner_request(StageWeights(version), timeout)
            mark("staged")
            expected = write_staged(staged.path, tensors, self.config.dtype)
            mark("written")
            self._owner_request(SealWeights(version, expected), timeout)
            mark("sealed")
            return staged.path
        except BaseException:
            self._in_loop(lambda: self._unstage(version))
            raise

    def _unstage(self, version: int) -> None:
        """(loop) The owner discards what it holds of `version` unless the node took it as
        sealed. Sent after the failed request, so the owner handles it after that request even
        when it answers late; a dead or failed owner's segments go with its replacement."""
        if version in self.owner_versions or self.owner is None or self.owner_failure is not None:
            return
        children.send(self.owner, UnstageWeights(version))

    def _owner_request(self, msg, timeout: float):
        """Send `msg` (numbered here) to the owner from the loop; the reply with the same
        request id and version resolves the future in `dispatch`, so the loop never blocks
        while the owner hashes, and a reply that comes after its request timed out is
        dropped instead of answering a later request."""
        msg = replace(msg, request_id=next(self._owner_request_ids))
        key = (msg.request_id, msg.version)
        reply: Future = Future()

        def send() -> None:
            with self._lock:
                if reply.cancelled():  # its caller gave up before the loop came to it
                    return
                if self.owner is None or self.owner.ready is None or self.owner_failure is not None:
                    reply.set_exception(
                        RolloutError("the memory owner is being replaced; publish again shortly")
                    )
                    return
                self._owner_replies[key] = reply
            children.send(self.owner, msg)

        self._in_loop(send)
        try:
            result = reply.result(timeout)
        except FutureTimeout:
            with self._lock:  # the loop resolves and registers under it: answered now, or never
                self._owner_replies.pop(key, None)
                if reply.cancel():
                    raise
            result = reply.result(0)
        if isinstance(result, SealRefused):
            error = PublishRefusedError if isinstance(msg, SealWeights) else BadRequestError
            raise error(result.message)
        return result

    # -- status ---------------------------------------------------------------------------

    def verify_weights(self) -> WeightsVerified:
        """Ask the owner to re-hash every tensor now; a mismatch triggers a cold start."""
        return self._in_loop(self._verify_weights).result(self.config.control_timeout_s + 60)

    def add_progress_listener(self, listener: Callable[[str, int], None]) -> None:
        """Call `listener(request_id, tokens_so_far)` on the loop thread after every delta
        (benchmarks and fault injection: act at an exact point of progress)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_progress_listener(self, listener: Callable[[str, int], None]) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def add_state_listener(self, listener: Callable[[dict], None]) -> None:
        """Call `listener(self.roles())` now and whenever a role, the epoch, a weights
        version or the recovery count changes (the node worker publishes it for `belayer chaos`)."""
        with self._lock:
            self._state_listeners.append(listener)
            listener(self.roles())

    def remove_state_listener(self, listener: Callable[[dict], None]) -> None:
        with self._lock:
            self._state_listeners.remove(listener)

    def roles(self) -> dict:
        """Pids by role, lease epoch, weights versions, recoveries so far and the last one."""
        with self._lock:
            state: dict[str, Any] = {
                "node_id": self.config.node_id,
                "owner": self.owner.pid if self.owner else None,
                "leader": self.leader.pid if self.leader else None,
                "shadow": self.shadow.pid if self.shadow else None,
                "shadow_ready": bool(self.shadow and self.shadow.ready),
                "epoch": self.epoch,
                "generation": self.generation,
                "weight_mode": self.config.weight_mode,
                "weights_version": self.target_version,
                "leader_version": self.leader.version if self.leader else None,
                "shadow_version": self.shadow.version if self.shadow and self.shadow.ready else None,
                "weights_versions_held": sorted(self.owner_versions),
                "publishing": self.publishing.version if self.publishing else None,
                "recoveries": len(self.recoveries),
                "broken": self.broken,
                "owner_state": self._owner_state(),
                "shadow_state": self._shadow_state(),
                "degraded": "; ".join(
                    [r.degraded for r in (self.owner_restarts, self.shadow_restarts) if r.degraded]
                    + ([self.restore_failure] if self.restore_failure else [])
                )
                or None,
                "protected": self._protected(),
                "hang_deadline": {
                    k: None if v is None else round(v, 4) for k, v in asdict(self._hang_deadlines()).items()
                },
                "last_owner_recovery": self.last_owner_recovery,
            }
            if self.recoveries:
                last = self.recoveries[-1]
                state["last_recovery"] = {
                    "kind": last.kind,
                    "reason": last.reason,
                    "fallback_reason": last.fallback_reason,
                    "ready_s": round(last.ready_s, 4),
                    "waited_for_shadow_s": round(last.waited_for_shadow_s, 4),
                    "replayed_requests": last.replayed_requests,
                    "replayed_tokens": last.replayed_tokens,
                    "phases": {k: round(v, 4) for k, v in last.phases.items()},
                }
            return state

    def _owner_state(self) -> str:
        if self.owner is None:
            return "none"
        if self.owner_restarts.degraded:
            return "degraded"
        if not self.owner.process.is_alive():
            return "waiting"  # its backoff before the next start
        if self.owner.ready is None or self.owner_failure is not None:
            return "re-adopting"
        if self.target_version not in self.owner_versions:
            return "restoring" if self.restoring is not None else "missing the served version"
        return "alive"

    def _shadow_state(self) -> str:
        if not self.config.shadow:
            return "off"
        if self.shadow_restarts.degraded:
            return "degraded"
        if self.shadow is None:
            return "waiting"  # its backoff, or a recovery, before the next start
        return "ready" if self.shadow.ready is not None else "starting"

    def _protected(self) -> bool:
        """A leader failure now would be a takeover: owner verified and alive, shadow ready
        on the version the node serves (or no shadow wanted)."""
        if self.leader is None or self._owner_state() != "alive":
            return False
        if not self.config.shadow:
            return True
        shadow = self.shadow
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

    def _validate(self, prompt_ids: list[int], spec: SamplingSpec) -> None:
        if not prompt_ids:
            raise BadRequestError("empty prompt: a request needs at least one token")
        bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size]
        if bad:
            raise BadRequestError(
                f"token id {bad[0]} is outside the model's vocabulary [0, {self.vocab_size}); "
                "the prefix was tokenized for a different model"
            )
        if len(prompt_ids) >= self.config.max_model_len:
            raise BadRequestError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.config.max_model_len} "
                "tokens (rollout.max_model_len); shorten the trajectory or raise the setting"
            )
        if spec.max_tokens < 1:
            raise BadRequestError(f"max_tokens must be >= 1, got {spec.max_tokens}")
        if spec.temperature < 0 or not 0 < spec.top_p <= 1 or spec.top_k < 0:
            raise BadRequestError(f"invalid sampling parameters: {spec}")

    # -- the loop -------------------------------------------------------------------------

    def _run_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._loop_once()
            except Exception:  # the loop must outlive any single bad message
                log.exception("rollout node %s: loop error", self.config.node_id)
                time.sleep(0.05)

    def _loop_once(self) -> None:
        # a dead owner waiting for its backoff is not watched: its sentinel stays ready
        watched = [
            c for c in (self.leader, self.shadow, self.owner) if c is not None and c is not self._dead_owner
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
        if (
            self.owner is not None
            and self.owner.process.sentinel in ready
            and self.owner is not self._dead_owner
        ):
            self._dead_owner = self.owner
            self._on_owner_death()
        self._replace_dead_owner_if_due()
        if self.shadow is not None and self.shadow.process.sentinel in ready:
            self._on_shadow_death()
        failure = self._leader_failure(ready)
        if failure is not None:
            recovery.recover(self, failure)
        self.start_shadow_if_due()
        self._advance_publish()
        self.send_unsent()
        self._note_protected_again()
        if time.monotonic() - self._state_published_at > STATE_REFRESH_S:
            self.notify_state()  # the hang deadline moves with every step

    def _note_protected_again(self) -> None:
        """Once the node is protected after its owner died, record how long that took."""
        if self._owner_lost is None or not self._protected():
            return
        lost_at, reason = self._owner_lost
        self._owner_lost = None
        self.last_owner_recovery = {
            "reason": reason,
            "protected_again_s": round(time.monotonic() - lost_at, 3),
            "owner_generation": self.generation,
        }
        log.warning(
            "rollout node %s: protected again %.2f s after %s",
            self.config.node_id,
            self.last_owner_recovery["protected_again_s"],
            reason,
        )
        self.notify_state()

    def _leader_failure(self, ready: list) -> str | None:
        leader = self.leader
        if leader is None:
            return None
        if leader.process.sentinel in ready:
            leader.process.join()  # already dead: reap it so the exit code is known
            return f"leader (pid {leader.pid}) died with exit code {leader.process.exitcode}"
        # A weights switch is a pause like an engine start: it does not heartbeat meanwhile.
        if leader.switching_to is not None:
            limit = max(self.config.heartbeat_timeout_s, self.config.engine_start_timeout_s)
        else:
            limit = self._hang_deadlines().current_s
        if time.monotonic() - leader.last_heard > limit:
            return (
                f"leader (pid {leader.pid}) missed heartbeats: silent for {limit:.1f} s, the hang deadline "
                f"derived from its step times (at most rollout.heartbeat_timeout_s = "
                f"{self.config.heartbeat_timeout_s} s)"
            )
        return None

    def _hang_deadlines(self) -> Deadlines:
        with self._lock:  # submits add records from other threads, status reads from any
            return self.hang.deadlines({r.engine_request_id for r in self.inflight.on_leader()})

    def dispatch(self, child: Child, msg: Any) -> None:
        """Handle one message from a child (under the node lock: it may touch the records,
        and control calls during a recovery dispatch from the loop without holding it)."""
        with self._lock:
            child.last_heard = time.monotonic()
            if isinstance(msg, StepOutput):  # only a leader steps; a fenced one's last tokens are real
                self.hang.stepped(msg.step_s, msg.prefilled_tokens, [d.engine_request_id for d in msg.deltas])
                self._on_step(msg)
            elif isinstance(msg, Rejected):
                record = self.inflight.on_engine(msg.engine_request_id)
                if record is not None:
                    self.inflight.fail(
                        record, BadRequestError(f"engine rejected request {record.request_id}: {msg.message}")
                    )
            elif isinstance(msg, (EngineReady, OwnerReady)):
                children.on_ready(child, msg)
                if isinstance(msg, OwnerReady):
                    self._owner_ready(msg)
                else:
                    if child is self.shadow:
                        self.shadow_restarts.ready()
                    log.info(
                        "rollout node %s: %s engine (pid %s) ready in %.2f s",
                        self.config.node_id,
                        child.role,
                        msg.pid,
                        msg.init_s,
                    )
                self.notify_state()
            elif isinstance(msg, (WeightsSwitched, SwitchFailed)):
                self._on_switched(child, msg)
            elif isinstance(msg, (Staged, Sealed, SealRefused)) and child is self.owner:
                self._on_owner_reply(msg)
            elif isinstance(msg, WeightsVerified) and child is self.owner and not msg.ok:
                versions = ", ".join(str(v) for v in msg.bad_versions)
                self.owner_failure = (
                    f"weights checksum mismatch in weights version {versions}: {list(msg.bad_tensors)[:3]}"
                )
                log.error("rollout node %s: %s", self.config.node_id, self.owner_failure)
                self._in_loop(lambda: recovery.recover(self, self.owner_failure) if self.leader else None)
            elif isinstance(msg, Failed):
                log.error("rollout node %s: %s reported: %s", self.config.node_id, child.role, msg.message)

    def _on_owner_reply(self, msg: Staged | Sealed | SealRefused) -> None:
        """(node lock held) Resolve the request `msg` answers. A reply nobody waits for any
        more (its request timed out; the failure unstages its version) is dropped: a late
        `Sealed` never makes a version the node holds."""
        reply = self._owner_replies.pop((msg.request_id, msg.version), None)
        if reply is None:
            log.warning(
                "rollout node %s: the memory owner's %s of weights version %d came after its "
                "request timed out; ignored",
                self.config.node_id,
                type(msg).__name__,
                msg.version,
            )
            return
        if isinstance(msg, Sealed):
            self.owner_versions[msg.version] = shm.weights_path(
                self.config.node_id, self.generation, msg.version
            )
        reply.set_result(msg)

    def _on_step(self, msg: StepOutput) -> None:
        now = time.monotonic()
        for delta in msg.deltas:
            record = self.inflight.on_engine(delta.engine_request_id)
            if record is None or record.done.is_set():
                continue  # a stale engine id (replayed elsewhere) or already finished
            if delta.token_ids:
                record.first_token_at = record.first_token_at or now
                record.last_token_at = now
                record.record(delta, msg.weights_version)
                if record.on_progress is not None:
                    record.on_progress(len(record.tokens))
                for listener in self._listeners:
                    listener(record.request_id, len(record.tokens))
            if record.spec.stop and self._hit_stop(record):
                children.send(self.leader, AbortRequest(delta.engine_request_id))
                self.inflight.finish(record, "stop")
            elif delta.finished:
                self.inflight.finish(record, delta.finish_reason or "stop")

    def _hit_stop(self, record: InFlight) -> bool:
        text = self._decode(record.tokens)
        return any(s in text for s in record.spec.stop)

    def send_unsent(self) -> None:
        """Send every logged request the leader does not have yet, if it may serve it: the
        one path for new submissions, replays after a recovery and re-sends after a publish."""
        leader = self.leader
        if leader is None or leader.ready is None or leader.switching_to is not None:
            return
        with self._lock:
            for record in self.inflight.unsent():
                if (record.pinned_version or self.target_version) != leader.version:
                    continue  # waits for the leader to be on its version
                request = self.inflight.request_for(record, self.config.max_model_len)
                if request is not None:
                    self.hang.sent(request.engine_request_id, len(request.prompt_ids))
                    children.send(leader, request)

    # -- publishing on the loop ---------------------------------------------------------

    def _switch_to(self, pub: Publish, version: int, path: Path) -> None:
        """The owner sealed `version`: from now on the engines must move to it."""
        with self._lock:
            self.owner_versions[version] = path
            if pub.policy == "finish_on_old":
                for record in self.inflight.on_leader():
                    record.pinned_version = self.leader.version
                    pub.drained_requests += 1
            self.target_version = version
        self.notify_state()

    def pinned_versions(self) -> set[int]:
        with self._lock:  # submits add records from other threads
            return {r.pinned_version for r in self.inflight.open() if r.pinned_version is not None}

    def _advance_publish(self) -> None:
        leader, shadow, target = self.leader, self.shadow, self.target_version
        if (
            leader is not None
            and leader.ready is not None
            and leader.version != target
            and leader.switching_to is None
        ):
            if not self.pinned_versions() & {leader.version}:
                self._pause_leader_requests()
                self._send_switch(leader)
        leader_moving = leader is not None and (leader.switching_to == target or leader.version == target)
        if (
            shadow is not None
            and shadow.ready is not None
            and shadow.version != target
            and shadow.switching_to is None
        ):
            # finish_on_old: the shadow stays on the old version while the leader drains, so a
            # takeover meanwhile can still finish the old requests.
            if leader_moving or not self.pinned_versions():
                self._send_switch(shadow)
        pub = self.publishing
        settled = (
            leader is not None and leader.version == target and (shadow is None or shadow.version == target)
        )
        if pub is not None and pub.version == target and settled and not pub.done.done():
            pub.mark("switched")
            self._drop_unused(keep={target, pub.previous_version})
            pub.done.set_result(None)
            self.notify_state()

    def _pause_leader_requests(self) -> None:
        """continue_on_new: abort what the leader is decoding; the records are re-sent (prompt
        + tokens so far) once it computes with the new version."""
        with self._lock:
            for record in self.inflight.on_leader():
                children.send(self.leader, AbortRequest(record.engine_request_id))
                self.inflight.detach(record)
                if self.publishing is not None:
                    self.publishing.paused_requests += 1

    def _send_switch(self, engine: Child) -> None:
        path = self.owner_versions.get(self.target_version)
        if path is None:
            return  # not sealed here (an owner replacement is adopting it): next iteration
        engine.switching_to = self.target_version
        children.send(engine, SwitchWeights(self.target_version, path))

    def _on_switched(self, engine: Child, msg) -> None:
        engine.switching_to = None
        if isinstance(msg, WeightsSwitched):
            engine.version = msg.version
            log.info(
                "rollout node %s: %s (pid %s) on weights version %d in %.3f s",
                self.config.node_id,
                engine.role,
                engine.pid,
                msg.version,
                msg.seconds,
            )
            self.notify_state()
            return
        log.error(
            "rollout node %s: %s (pid %s) could not switch to version %d: %s",
            self.config.node_id,
            engine.role,
            engine.pid,
            msg.version,
            msg.message,
        )
        engine.switch_failed = True
        if engine is self.shadow:  # never keep a shadow behind: replace it by one on the target
            self._in_loop(lambda: self._replace_behind_shadow(engine))
        elif engine is self.leader:
            self._in_loop(
                lambda: recovery.recover(
                    self, f"leader could not switch to weights version {msg.version}: {msg.message}"
                )
            )

    def _replace_behind_shadow(self, behind: Child) -> None:
        if self.shadow is behind:
            children.stop(self.set_role("shadow", None))
            self.start_shadow_if_due()

    # -- shadow ---------------------------------------------------------------------------

    def _await_start_shadow(self) -> None:
        """The first shadow: a node whose shadow cannot start still serves (degraded later)."""
        try:
            self.await_engine(self.shadow)
            self.shadow_restarts.ready()
        except EngineStartError as exc:
            self._on_shadow_death(str(exc))

    def _on_shadow_death(self, why: str | None = None) -> None:
        shadow = self.set_role("shadow", None)
        children.stop(shadow)
        why = why or f"pid {shadow.pid} exited with {shadow.process.exitcode}" + (
            "" if shadow.ready else " while starting"
        )
        delay = self.shadow_restarts.died(why)
        log.error("rollout node %s: shadow %s; next shadow start in %.0f s", self.config.node_id, why, delay)
        if self.shadow_restarts.degraded:
            log.error("rollout node %s: degraded: %s", self.config.node_id, self.shadow_restarts.degraded)
        self.notify_state()

    def start_shadow_if_due(self) -> None:
        """Start a shadow if the node should have one and has none, once its backoff allows
        (loop thread; a recovery calls it too, so a takeover is followed by a new shadow)."""
        version = self._shadow_version()
        if (
            not self.config.shadow
            or self.shadow is not None
            or self.leader is None
            or self.broken
            or self.owner_failure is not None
            or version not in self.owner_versions
            or not self.shadow_restarts.due()
        ):
            return
        self.shadow_restarts.started()
        self.set_role("shadow", self.spawn_engine("shadow", version))

    def _shadow_version(self) -> int:
        """What a new shadow loads: while a finish-on-old drain keeps the leader on the
        version its requests are pinned to, that version (a takeover meanwhile must finish
        them on it; a shadow on the new one would un-pin them), and the shadow follows the
        leader to the new one afterwards; otherwise the version the node serves."""
        leader = self.leader
        if leader is not None and leader.version in self.pinned_versions():
            return leader.version
        return self.target_version

    def _drop_unused(self, keep: set[int]) -> None:
        in_use = (
            {c.version for c in (self.leader, self.shadow) if c is not None}
            | self.pinned_versions()
            | {self.target_version}
        )
        drop = tuple(v for v in self.owner_versions if v not in keep | in_use)
        if drop and self.owner is not None and self.owner_failure is None:
            children.send(self.owner, DropWeights(drop))
            for version in drop:
                self.owner_versions.pop(version, None)

    # -- owner ----------------------------------------------------------------------------

    def _on_owner_death(self) -> None:
        owner = self.owner
        owner.process.join(children.REAP_TIMEOUT_S)  # dead (its sentinel fired): reap it for its exit code
        self.owner_failure = f"memory owner (pid {owner.pid}) exited with {owner.process.exitcode}" + (
            "" if owner.ready else " while starting"
        )
        self._owner_lost = self._owner_lost or (time.monotonic(), self.owner_failure)
        delay = self.owner_restarts.died(self.owner_failure)
        log.error(
            "rollout node %s: %s; a replacement adopts its verified segments in %.0f s",
            self.config.node_id,
            self.owner_failure,
            delay,
        )
        if self.owner_restarts.degraded:
            log.error("rollout node %s: degraded: %s", self.config.node_id, self.owner_restarts.degraded)
        with self._lock:
            for reply in self._owner_replies.values():
                reply.set_exception(RolloutError(f"{self.owner_failure} during the publish; publish again"))
            self._owner_replies = {}
        self.notify_state()

    def _replace_dead_owner_if_due(self) -> None:
        owner = self.owner
        if owner is not None and not owner.process.is_alive() and self.owner_restarts.due():
            self.replace_owner()  # a staged, unsealed segment is not adopted

    def replace_owner(self, wait: bool = False) -> None:
        """Start an owner that adopts the current one's sealed segments and arena (verifying
        every tensor) or, for a new node, loads the weights from disk."""
        old = self.owner
        adopt: dict[str, Any] = {"current_version": self.target_version}
        if self.owner_versions:  # the last ready owner's sealed segments and arena
            adopt["adopt_weights"] = dict(self.owner_versions)
            adopt["adopt_arena"] = self._arena_path
        if old is not None:
            children.fence(old)  # not Stop: a stopping owner unlinks the segments being adopted
            children.close_conn(old)
        self.owner_restarts.started()
        self.generation += 1
        owner = children.spawn_owner(self.config, self.model_dir, self.generation, **adopt)
        self.set_role("owner", owner)
        if wait:
            self.await_owner()

    def await_owner(self) -> None:
        if self.owner.ready is None:
            children.await_ready(self.owner, self.config.engine_start_timeout_s, self.dispatch)
            self._owner_ready(self.owner.ready)

    def _owner_ready(self, ready: OwnerReady) -> None:
        self.owner_failure = None
        self.owner_restarts.ready()
        self._arena_path = ready.arena_path
        self.owner_versions = dict(ready.versions)
        self._check_rejected(ready.rejected)
        keep = {*ready.versions.values(), ready.arena_path}
        mapped = {c.spec.arena_path for c in (self.leader, self.shadow) if c is not None}
        for path in shm.leftover_segments(self.config.node_id):
            if path not in keep and path not in mapped:
                path.unlink(missing_ok=True)  # a predecessor's staged or dropped segment

    def _check_rejected(self, rejected: tuple[int, ...]) -> None:
        """A segment the new owner would not adopt failed verification. Version 1 it rebuilt
        from the model files; a published version is staged again from the weight source.
        Engines that read it in place (shared) computed with bad bytes, so the leader is
        replaced (the shadow must prove its own weights by sketch, or it is a cold start)
        once the owner holds the version again. Private engines computed from their own
        copies, made when the segment still verified."""
        if not rejected:
            return
        log.error(
            "rollout node %s: the new owner rejected weights version(s) %s (failed verification)",
            self.config.node_id,
            list(rejected),
        )
        in_use = {c.version for c in (self.leader, self.shadow) if c is not None} & set(rejected)
        why = f"weights version(s) {sorted(in_use)} the engines read failed verification"
        replace_leader = self.config.weight_mode == "shared" and bool(in_use) and self.leader is not None
        if self.target_version in self.owner_versions:
            if replace_leader:
                self._in_loop(lambda: recovery.recover(self, why) if self.leader else None)
            return
        self.restoring, self.restore_failure = self.target_version, None
        threading.Thread(
            target=self._restore_lost_version,
            args=(self.target_version, why if replace_leader else None),
            name=f"belayer-{self.config.node_id}-restore",
            daemon=True,
        ).start()

    def _restore_lost_version(self, version: int, then_recover: str | None) -> None:
        """Stage, write and seal `version` again from the weight source (off the loop)."""
        timeout = self.config.publish_timeout_s
        try:
            tensors = self.weight_source(version) if self.weight_source is not None else None
            if tensors is None:
                raise RolloutError(
                    f"weights version {version} was lost with the memory owner and no weight "
                    "source holds it; publish it again"
                )
            self._stage_write_seal(version, tensors, timeout)
            log.warning(
                "rollout node %s: weights version %d staged again from its source",
                self.config.node_id,
                version,
            )
            if then_recover:
                self._in_loop(lambda: recovery.recover(self, then_recover) if self.leader else None)
        except Exception as exc:  # the node goes on serving from the engines' own memory
            self.restore_failure = f"could not restore weights version {version}: {exc}"
            log.error("rollout node %s: %s", self.config.node_id, self.restore_failure)
        finally:
            self.restoring = None
            self._wake()

    # -- children (loop thread) ---------------------------------------------------------

    def set_role(self, role: str, child: Child | None) -> Child | None:
        with self._lock:
            old = getattr(self, role)
            setattr(self, role, child)
        self.notify_state()
        return old

    def spawn_engine(self, role: str, version: int | None = None) -> Child:
        """An engine on `version` (default: the version the node serves)."""
        version = self.target_version if version is None else version
        if version not in self.owner_versions:
            raise RolloutError(
                f"the memory owner does not hold weights version {version} "
                f"({self.restore_failure or 'it is being restored'}); no engine can load it"
            )
        weights = (version, self.owner_versions[version])
        return children.spawn_engine(
            self.config, self.model_dir, weights, self.owner.ready.arena_path, self.generation, role
        )

    def await_engine(self, engine: Child) -> None:
        children.await_ready(engine, self.config.engine_start_timeout_s, self.dispatch)
        if engine.switching_to is not None:
            deadline = time.monotonic() + self.config.engine_start_timeout_s
            while engine.switching_to is not None and time.monotonic() < deadline:
                if engine.conn.poll(0.05):
                    children.drain(engine, self.dispatch)
                elif not engine.process.is_alive():
                    raise RolloutError(f"{engine.role} (pid {engine.pid}) died while switching weights")

    def take_lease(self, engine: Child) -> None:
        reply = children.call(engine, TakeLease(), LeaseTaken, self.config.control_timeout_s, self.dispatch)
        self.epoch = reply.epoch
        engine.last_heard = time.monotonic()  # its silence is measured from becoming leader

    def _verify_weights(self) -> WeightsVerified:
        result = children.call(
            self.owner, VerifyWeights(), WeightsVerified, self.config.control_timeout_s + 60, self.dispatch
        )
        if not result.ok:
            self.dispatch(self.owner, result)
        return result

    def _in_loop(self, fn: Callable[[], Any]) -> Future:
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
        self._wake()
        return future

    def _run_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fn, future in pending:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _wake(self) -> None:
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

    def _decode(self, tokens: list[int]) -> str:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        return self._tokenizer.decode(tokens, skip_special_tokens=True)


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
