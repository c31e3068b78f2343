"""The node supervisor: one rollout node's memory owner, leader engine and shadow engine.

It forwards requests to the leader (which batches them continuously), keeps the in-flight
log (prompt ids, tokens streamed so far, sampling parameters with seed) that every
recovery replays from, and watches its children: a dead leader is seen at once (process
sentinel), a hung one by missed heartbeats. Recovery follows docs/design.md §3: fence,
owner check, device check, lease epoch + 1 on the shadow, re-prefill every in-flight
request, new shadow in the background; a failed owner or device check means a cold start,
recorded as such. All child I/O happens on one pump thread; callers only submit and wait.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from belayer.workers.rollout import shm
from belayer.workers.rollout.config import RolloutConfig
from belayer.workers.rollout.engine import engine_main
from belayer.workers.rollout.errors import (
    BadRequestError,
    EngineStartError,
    NodeClosedError,
    RolloutError,
)
from belayer.workers.rollout.owner import owner_main
from belayer.workers.rollout.procutil import memory_of
from belayer.workers.rollout.protocol import (
    AbortRequest,
    AddRequest,
    EngineReady,
    EngineSpec,
    Failed,
    HealthCheck,
    HealthResult,
    LeaseTaken,
    OwnerReady,
    OwnerSpec,
    Rejected,
    SamplingSpec,
    StepOutput,
    Stop,
    TakeLease,
    VerifyWeights,
    WeightsVerified,
)

log = logging.getLogger("belayer.rollout")
_MP = mp.get_context("spawn")  # never fork a process that may hold vLLM / OpenMP state


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Completion:
    """What a request produced, and what the node went through to produce it."""

    request_id: str
    prompt_len: int
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_s: float
    decode_s_per_token: float
    recoveries: tuple[str, ...]


@dataclass(frozen=True)
class RecoveryEvent:
    """One takeover or cold start, with the time of each phase (seconds)."""

    kind: str  # "takeover" | "cold_start"
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


@dataclass
class _InFlight:
    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    submitted_at: float
    tokens: list[int] = field(default_factory=list)
    engine_request_id: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    error: RolloutError | None = None
    recoveries: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    on_progress: Callable[[int], None] | None = None

    @property
    def remaining(self) -> int:
        return self.spec.max_tokens - len(self.tokens)


class RequestHandle:
    """A submitted request: wait for its `Completion`, or look at its progress."""

    def __init__(self, node: RolloutNode, record: _InFlight):
        self._node, self._record = node, record

    @property
    def request_id(self) -> str:
        return self._record.request_id

    def tokens_so_far(self) -> list[int]:
        # Lock-free on purpose: a cold start holds the node lock for seconds, and heartbeats
        # must not wait for it. The list only grows (pump thread) and copying it is atomic
        # under the GIL, so this is a consistent prefix of the request's tokens.
        return list(self._record.tokens)

    def done(self) -> bool:
        return self._record.done.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        if not self._record.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self._record.error is not None:
            raise self._record.error
        return self._node._completion(self._record)


@dataclass
class _Child:
    role: str
    process: Any
    conn: Connection
    ready: Any = None  # EngineReady | OwnerReady once up
    last_heard: float = field(default_factory=time.monotonic)
    spec: Any = None

    @property
    def pid(self) -> int | None:
        return self.process.pid


# ----------------------------------------------------------------------------- node


class RolloutNode:
    """Owner + leader + shadow of one node. `start()`, `submit()`, `close()`."""

    def __init__(self, config: RolloutConfig, model_dir: Path):
        self.config = config
        self.model_dir = Path(model_dir)
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._inflight: dict[str, _InFlight] = {}
        self._by_engine_id: dict[str, _InFlight] = {}
        self.recoveries: list[RecoveryEvent] = []
        self.owner: _Child | None = None
        self.leader: _Child | None = None
        self.shadow: _Child | None = None
        self.generation = 0
        self.epoch = 0
        self.reference_digest: str | None = None
        self.owner_failure: str | None = None
        self._pending: list[tuple[Callable[[], Any], Future]] = []
        self._forced_fallback: str | None = None
        self._listeners: list[Callable[[str, int], None]] = []
        self._state_listeners: list[Callable[[dict], None]] = []
        self.broken: str | None = None  # set when no engine could be started: the node refuses work
        self._wake_r, self._wake_w = _MP.Pipe(duplex=False)
        self._closed = threading.Event()
        self._pump: threading.Thread | None = None
        self._tokenizer = None
        self.vocab_size = _vocab_size(self.model_dir)

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, wait_shadow: bool = True) -> RolloutNode:
        """Owner, then primary (leader), then shadow; returns when the leader serves."""
        stale = shm.unlink_segments(self.config.node_id)
        if stale:
            log.warning("removed stale shared memory of node %s: %s", self.config.node_id, stale)
        try:
            self._start_owner()
            self.leader = self._start_engine("primary")
            self._await_ready(self.leader)
            self.reference_digest = self.leader.ready.device_digest
            self._take_lease(self.leader)
            if self.config.shadow:
                self.shadow = self._start_engine("shadow")
                if wait_shadow:
                    self._await_ready(self.shadow)
        except BaseException:
            self.close()
            raise
        self._pump = threading.Thread(
            target=self._pump_loop, name=f"belayer-{self.config.node_id}-pump", daemon=True
        )
        self._pump.start()
        return self

    def close(self) -> None:
        """Stop every child, unlink the node's shared memory; fail requests still in flight."""
        self._closed.set()
        self._wake()
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join(timeout=10)
        with self._lock:
            for child in (self.shadow, self.leader, self.owner):
                if child is not None:
                    _stop_child(child)
            self.shadow = self.leader = self.owner = None
            for record in list(self._inflight.values()):
                self._fail(record, NodeClosedError(f"rollout node {self.config.node_id} closed"))
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
        deadline = time.monotonic() + (timeout or self.config.engine_start_timeout_s)
        while time.monotonic() < deadline:
            with self._lock:
                if self.shadow is not None and self.shadow.ready is not None:
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
        """Validate, log and forward one request to the leader. Bad input raises
        `BadRequestError` (non-retryable) and leaves the node serving."""
        self._validate(prompt_ids, spec)
        if self._closed.is_set():
            raise NodeClosedError(f"rollout node {self.config.node_id} is closed")
        if self.broken is not None:
            raise RolloutError(
                f"rollout node {self.config.node_id} cannot serve ({self.broken}); retry elsewhere"
            )
        record = _InFlight(
            request_id or uuid.uuid4().hex, list(prompt_ids), spec, time.monotonic(), on_progress=on_progress
        )
        with self._lock:
            if record.request_id in self._inflight:
                raise BadRequestError(f"request id {record.request_id} is already in flight")
            self._inflight[record.request_id] = record
            log.debug("request %s: %d prompt tokens, %s", record.request_id, len(record.prompt_ids), spec)
            if self.leader is not None and self.leader.ready is not None:
                self._send_to_leader(record)
        return RequestHandle(self, record)

    def cancel(self, request_id: str, why: str = "cancelled by the caller") -> None:
        """Drop a request (e.g. its activity was cancelled): the leader stops decoding it."""
        with self._lock:
            record = self._inflight.get(request_id)
            if record is None:
                return
            if record.engine_request_id is not None:
                self._send_leader(AbortRequest(record.engine_request_id))
            self._fail(record, NodeClosedError(f"request {request_id}: {why}"))

    def generate(self, prompt_ids: list[int], spec: SamplingSpec, timeout: float | None = None) -> Completion:
        return self.submit(prompt_ids, spec).result(timeout)

    def verify_weights(self) -> WeightsVerified:
        """Ask the owner to re-hash every tensor now; a mismatch triggers a cold start."""
        return self._in_pump(self._verify_weights).result(self.config.control_timeout_s + 60)

    def add_progress_listener(self, listener: Callable[[str, int], None]) -> None:
        """Call `listener(request_id, tokens_so_far)` on the pump thread after every delta
        (benchmarks and fault injection: act at an exact point of progress)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_progress_listener(self, listener: Callable[[str, int], None]) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def add_state_listener(self, listener: Callable[[dict], None]) -> None:
        """Call `listener(self.roles())` now and whenever a role, the epoch or the recovery
        count changes (the node worker publishes it for `belayer chaos`)."""
        with self._lock:
            self._state_listeners.append(listener)
            listener(self.roles())

    def remove_state_listener(self, listener: Callable[[dict], None]) -> None:
        with self._lock:
            self._state_listeners.remove(listener)

    def roles(self) -> dict:
        """Pids by role, lease epoch, owner generation, recoveries so far and the last one."""
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
                "recoveries": len(self.recoveries),
                "broken": self.broken,
            }
            if self.recoveries:
                last = self.recoveries[-1]
                state["last_recovery"] = {
                    "kind": last.kind,
                    "reason": last.reason,
                    "fallback_reason": last.fallback_reason,
                    "ready_s": round(last.ready_s, 4),
                    "replayed_requests": last.replayed_requests,
                    "replayed_tokens": last.replayed_tokens,
                    "phases": {k: round(v, 4) for k, v in last.phases.items()},
                }
            return state

    def _notify_state(self) -> None:
        if not self._state_listeners:
            return
        state = self.roles()
        for listener in list(self._state_listeners):
            try:
                listener(state)
            except Exception:  # a publisher must never break the node
                log.exception("rollout node %s: state listener failed", self.config.node_id)

    def force_full_cold_start_next(self, why: str) -> None:
        """Make the next recovery a full cold start (new owner loading weights from disk, new
        engine): the comparison point of `belayer bench worker-recovery`."""
        with self._lock:
            self._forced_fallback = f"full cold start requested: {why}"

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

    # -- pump thread ----------------------------------------------------------------------

    def _pump_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._pump_once()
            except Exception:  # the pump must outlive any single bad message
                log.exception("rollout node %s: pump error", self.config.node_id)
                time.sleep(0.05)

    def _pump_once(self) -> None:
        with self._lock:
            children = [c for c in (self.leader, self.shadow) if c is not None]
            if self.owner is not None and self.owner_failure is None:
                children.append(self.owner)  # a dead owner's pipe and sentinel stay readable forever
        waitables: list[Any] = [self._wake_r]
        for c in children:
            waitables += [c.conn, c.process.sentinel]
        ready = wait(waitables, timeout=min(self.config.heartbeat_interval_s, 0.1))
        with self._lock:
            if self._wake_r in ready:
                while self._wake_r.poll(0):
                    self._wake_r.recv()
            self._run_pending()
            for child in children:
                if child.conn in ready:
                    self._drain(child)
            if self._closed.is_set():
                return
            if self.owner is not None and self.owner.process.sentinel in ready and self.owner_failure is None:
                self.owner_failure = (
                    f"memory owner (pid {self.owner.pid}) exited with {self.owner.process.exitcode}"
                )
                log.error(
                    "rollout node %s: %s; the next recovery will be a cold start",
                    self.config.node_id,
                    self.owner_failure,
                )
                self._notify_state()
            if self.shadow is not None and self.shadow.process.sentinel in ready:
                log.error(
                    "rollout node %s: shadow (pid %s) died; starting another",
                    self.config.node_id,
                    self.shadow.pid,
                )
                _stop_child(self.shadow)
                self.shadow = self._start_engine("shadow") if self.config.shadow else None
                self._notify_state()
            leader = self.leader
            if leader is None:
                return
            if leader.process.sentinel in ready:
                leader.process.join()  # already dead: reap it so the exit code is known
                self._recover(f"leader (pid {leader.pid}) died with exit code {leader.process.exitcode}")
            elif time.monotonic() - leader.last_heard > self.config.heartbeat_timeout_s:
                self._recover(
                    f"leader (pid {leader.pid}) missed heartbeats for {self.config.heartbeat_timeout_s} s"
                )

    def _drain(self, child: _Child) -> None:
        try:
            while child.conn.poll(0):
                self._dispatch(child, child.conn.recv())
        except (EOFError, OSError):
            pass  # its death is handled through the sentinel

    def _dispatch(self, child: _Child, msg: Any) -> None:
        child.last_heard = time.monotonic()
        if isinstance(msg, StepOutput):
            for delta in msg.deltas:
                self._on_delta(delta)
        elif isinstance(msg, Rejected):
            record = self._by_engine_id.pop(msg.engine_request_id, None)
            if record is not None:
                self._fail(
                    record, BadRequestError(f"engine rejected request {record.request_id}: {msg.message}")
                )
        elif isinstance(msg, EngineReady):
            child.ready = msg
            log.info(
                "rollout node %s: %s engine (pid %s) ready in %.2f s",
                self.config.node_id,
                child.role,
                msg.pid,
                msg.init_s,
            )
            self._notify_state()
        elif isinstance(msg, WeightsVerified) and child is self.owner and not msg.ok:
            self.owner_failure = f"weights checksum mismatch in {list(msg.bad_tensors)[:3]}"
            log.error("rollout node %s: %s", self.config.node_id, self.owner_failure)
            if self.leader is not None:
                self._recover(self.owner_failure)
        elif isinstance(msg, Failed):
            log.error("rollout node %s: %s reported: %s", self.config.node_id, child.role, msg.message)

    def _on_delta(self, delta) -> None:
        record = self._by_engine_id.get(delta.engine_request_id)
        if record is None or record.done.is_set():
            return  # a stale engine id (replayed elsewhere) or already finished
        now = time.monotonic()
        if delta.token_ids:
            record.first_token_at = record.first_token_at or now
            record.last_token_at = now
            record.tokens.extend(delta.token_ids)
            if record.on_progress is not None:
                record.on_progress(len(record.tokens))
            for listener in self._listeners:
                listener(record.request_id, len(record.tokens))
        if record.spec.stop and self._hit_stop(record):
            self._send_leader(AbortRequest(delta.engine_request_id))
            self._finish(record, "stop")
        elif delta.finished:
            self._finish(record, delta.finish_reason or "stop")

    def _hit_stop(self, record: _InFlight) -> bool:
        text = self._decode(record.tokens)
        return any(s in text for s in record.spec.stop)

    def _finish(self, record: _InFlight, reason: str) -> None:
        record.finish_reason = reason
        self._forget(record)
        record.done.set()

    def _fail(self, record: _InFlight, error: RolloutError) -> None:
        record.error = error
        self._forget(record)
        record.done.set()

    def _forget(self, record: _InFlight) -> None:
        self._inflight.pop(record.request_id, None)
        if record.engine_request_id is not None:
            self._by_engine_id.pop(record.engine_request_id, None)

    def _send_to_leader(self, record: _InFlight) -> None:
        """(Re)send a logged request: prompt + tokens so far, the rest of its budget."""
        if record.engine_request_id is not None:
            self._by_engine_id.pop(record.engine_request_id, None)
        if record.remaining <= 0:
            self._finish(record, "length")
            return
        record.engine_request_id = f"{record.request_id}#{next(self._ids)}"
        self._by_engine_id[record.engine_request_id] = record
        prompt = record.prompt_ids + record.tokens
        if len(prompt) >= self.config.max_model_len:
            self._finish(record, "length")
            return
        self._send_leader(
            AddRequest(record.engine_request_id, prompt, record.spec, record.remaining, len(prompt))
        )

    def _send_leader(self, msg: Any) -> None:
        try:
            self.leader.conn.send(msg)
        except (OSError, AttributeError):
            pass  # leader gone: the recovery replays everything in flight

    # -- recovery -------------------------------------------------------------------------

    def _recover(self, reason: str) -> None:
        detected = time.monotonic()
        old, self.leader = self.leader, None
        phases: dict[str, float] = {}
        t = time.perf_counter()
        _fence(old)
        self._drain(old)  # tokens it streamed before dying are real: keep them
        _close_conn(old)
        phases["fence_s"] = time.perf_counter() - t
        log.error(
            "rollout node %s: %s; recovering %d in-flight requests",
            self.config.node_id,
            reason,
            len(self._inflight),
        )

        fallback, self._forced_fallback = self._forced_fallback, None
        if fallback is None:
            fallback = self._owner_check(phases)
        if fallback is None:
            fallback = self._device_check(phases)
        kind = "takeover"
        if fallback is None:
            t = time.perf_counter()
            try:
                self._take_lease(self.shadow)
                self.leader, self.shadow = self.shadow, None
            except RolloutError as exc:
                fallback = f"shadow could not take the lease: {exc}"
            phases["lease_s"] = time.perf_counter() - t
        if fallback is not None:
            kind = "cold_start"
            log.error("rollout node %s: falling back to a cold start: %s", self.config.node_id, fallback)
            owner_bad = self.owner_failure is not None or "owner" in fallback or "full cold start" in fallback
            try:
                self._cold_start(phases, owner_bad=owner_bad)
            except RolloutError as exc:
                # Nothing left to serve on: tell every request, retryable elsewhere (Temporal
                # retries the activity on another node, resuming from its heartbeat).
                log.error("rollout node %s: cold start failed: %s", self.config.node_id, exc)
                self.broken = f"cold start failed: {exc}"
                self._notify_state()
                for record in list(self._inflight.values()):
                    self._fail(
                        record, RolloutError(f"rollout node {self.config.node_id} lost its engine: {exc}")
                    )
                return

        t = time.perf_counter()
        records = [r for r in self._inflight.values() if not r.done.is_set()]
        for record in records:
            record.recoveries.append(kind)
            self._send_to_leader(record)
        phases["replay_send_s"] = time.perf_counter() - t
        ready_at = time.monotonic()
        event = RecoveryEvent(
            kind=kind,
            reason=reason,
            fallback_reason=fallback,
            failed_pid=old.pid if old else None,
            epoch=self.epoch,
            ready_s=ready_at - detected,
            phases=phases,
            replayed_requests=len(records),
            replayed_tokens=sum(len(r.prompt_ids) + len(r.tokens) for r in records),
            detected_at=detected,
            ready_at=ready_at,
        )
        self.recoveries.append(event)
        log.warning(
            "rollout node %s: %s done in %.3f s (epoch %d, %d requests re-prefilled)%s",
            self.config.node_id,
            kind,
            event.ready_s,
            self.epoch,
            len(records),
            f"; cold start because {fallback}" if fallback else "",
        )
        if self.config.shadow and self.shadow is None:
            self.shadow = self._start_engine("shadow")  # in the background: the pump sees it ready
        self._notify_state()

    def _owner_check(self, phases: dict[str, float]) -> str | None:
        t = time.perf_counter()
        try:
            if self.owner_failure is not None:
                return self.owner_failure
            if self.owner is None or not self.owner.process.is_alive():
                return "memory owner is not running"
            header = shm.read_arena_header(self.owner.ready.arena_path)
            if header.epoch != self.epoch:
                return f"arena epoch is {header.epoch}, expected {self.epoch}: someone else wrote the lease"
            weights = shm.map_readonly(self.owner.ready.weights_path)
            try:
                status = shm.read_weights_header(weights).status
            finally:
                weights.close()
            if status != shm.STATUS_OK:
                return "owner's weights are marked corrupt"
            return None
        except shm.SharedMemoryError as exc:
            return f"owner memory not intact: {exc}"
        finally:
            phases["owner_check_s"] = time.perf_counter() - t

    def _device_check(self, phases: dict[str, float]) -> str | None:
        t = time.perf_counter()
        try:
            if self.shadow is None:
                return "no shadow engine configured"
            if self.shadow.ready is None:
                log.warning("rollout node %s: shadow still initializing; waiting for it", self.config.node_id)
                self._await_ready(self.shadow)
            result = self._call(self.shadow, HealthCheck(self.reference_digest), HealthResult)
            if not result.ok:
                return f"device health check failed on the shadow (digest {result.digest[:12]})"
            return None
        except RolloutError as exc:
            return f"shadow unusable: {exc}"
        finally:
            phases["device_check_s"] = time.perf_counter() - t

    def _cold_start(self, phases: dict[str, float], owner_bad: bool) -> None:
        t = time.perf_counter()
        if self.shadow is not None:
            _stop_child(self.shadow)
            self.shadow = None
        if owner_bad or self.owner is None or not self.owner.process.is_alive():
            if self.owner is not None:
                _stop_child(self.owner)
            shm.unlink_segments(self.config.node_id)
            self._start_owner()
            self.owner_failure = None
        phases["owner_restart_s"] = time.perf_counter() - t
        t = time.perf_counter()
        engine = self._start_engine("cold")
        self._await_ready(engine)
        self._take_lease(engine)
        self.leader = engine
        phases["engine_start_s"] = time.perf_counter() - t

    # -- children -------------------------------------------------------------------------

    def _start_owner(self) -> None:
        self.generation += 1
        self.epoch = 0
        spec = OwnerSpec(
            node_id=self.config.node_id,
            generation=self.generation,
            model_dir=self.model_dir,
            dtype=self.config.dtype,
            kv_bytes=self.config.kv_cache_mb << 20,
            verify_interval_s=self.config.weights_verify_interval_s,
        )
        parent, child = _MP.Pipe()
        process = _MP.Process(
            target=owner_main, args=(spec, child), name=f"belayer-{self.config.node_id}-owner", daemon=True
        )
        process.start()
        child.close()
        self.owner = _Child("owner", process, parent, spec=spec)
        self._await_ready(self.owner)

    def _start_engine(self, role: str) -> _Child:
        ready: OwnerReady = self.owner.ready
        spec = EngineSpec(
            node_id=self.config.node_id,
            role=role,
            model_dir=self.model_dir,
            weights_path=ready.weights_path,
            arena_path=ready.arena_path,
            dtype=self.config.dtype,
            weight_mode=self.config.weight_mode,
            kv_bytes=self.config.kv_cache_mb << 20,
            max_model_len=self.config.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            threads=self.config.engine_threads,
        )
        parent, child = _MP.Pipe()
        process = _MP.Process(
            target=engine_main, args=(spec, child), name=f"belayer-{self.config.node_id}-{role}", daemon=True
        )
        process.start()
        child.close()
        return _Child(role, process, parent, spec=spec)

    def _await_ready(self, child: _Child) -> None:
        if child.ready is not None:
            return
        deadline = time.monotonic() + self.config.engine_start_timeout_s
        while child.ready is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartError(
                    f"{child.role} not ready after {self.config.engine_start_timeout_s} s "
                    "(rollout.engine_start_timeout_s)"
                )
            if not child.conn.poll(min(left, 0.5)):
                if not child.process.is_alive():
                    raise EngineStartError(
                        f"{child.role} (pid {child.pid}) exited with {child.process.exitcode} while starting"
                    )
                continue
            msg = child.conn.recv()
            if isinstance(msg, Failed):
                raise EngineStartError(msg.message)
            if isinstance(msg, (EngineReady, OwnerReady)):
                child.ready = msg
            else:
                self._dispatch(child, msg)

    def _take_lease(self, engine: _Child) -> None:
        reply = self._call(engine, TakeLease(), LeaseTaken)
        self.epoch = reply.epoch
        engine.last_heard = time.monotonic()  # its silence is measured from becoming leader

    def _call(self, child: _Child, msg: Any, reply_type: type) -> Any:
        """Send a control message and wait for its reply, dispatching anything else."""
        child.conn.send(msg)
        deadline = time.monotonic() + self.config.control_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutError(
                    f"{child.role} did not answer {type(msg).__name__} in {self.config.control_timeout_s} s"
                )
            try:
                if not child.conn.poll(left):
                    continue
                reply = child.conn.recv()
            except (EOFError, OSError):
                raise RolloutError(
                    f"{child.role} (pid {child.pid}) died during {type(msg).__name__}"
                ) from None
            if isinstance(reply, reply_type):
                return reply
            if isinstance(reply, Failed):
                raise RolloutError(reply.message)
            self._dispatch(child, reply)

    def _verify_weights(self) -> WeightsVerified:
        result = self._call(self.owner, VerifyWeights(), WeightsVerified)
        if not result.ok:
            self._dispatch(self.owner, result)
        return result

    def _in_pump(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            self._pending.append((fn, future))
        self._wake()
        return future

    def _run_pending(self) -> None:
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

    # -- results --------------------------------------------------------------------------

    def _completion(self, record: _InFlight) -> Completion:
        text = self._decode(record.tokens)
        for stop in record.spec.stop:
            if stop in text:
                text = text[: text.index(stop)]
        first = record.first_token_at or record.submitted_at
        last = record.last_token_at or first
        n = len(record.tokens)
        return Completion(
            request_id=record.request_id,
            prompt_len=len(record.prompt_ids),
            token_ids=list(record.tokens),
            text=text,
            finish_reason=record.finish_reason or "stop",
            prefill_s=first - record.submitted_at,
            decode_s_per_token=(last - first) / (n - 1) if n > 1 else 0.0,
            recoveries=tuple(record.recoveries),
        )

    def _decode(self, tokens: list[int]) -> str:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        return self._tokenizer.decode(tokens, skip_special_tokens=True)


# ----------------------------------------------------------------------------- helpers


def _vocab_size(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _fence(child: _Child | None) -> None:
    """Kill and reap: once this returns the kernel has released the child's lease lock."""
    if child is None:
        return
    if child.process.is_alive():
        child.process.kill()
    child.process.join()


def _close_conn(child: _Child | None) -> None:
    if child is not None:
        try:
            child.conn.close()
        except OSError:
            pass


def _stop_child(child: _Child, grace_s: float = 5.0) -> None:
    try:
        if child.process.is_alive():
            child.conn.send(Stop())
    except (OSError, ValueError):
        pass
    child.process.join(grace_s)
    if child.process.is_alive():
        child.process.kill()
        child.process.join()
    _close_conn(child)
