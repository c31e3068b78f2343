"""An engine worker process: one in-process vLLM engine serving the node's leader role.

Its loop is small: take control messages, step the engine when it holds the lease and has
work, stream token deltas (with each token's logprob and the weights version of the step),
heartbeat. A weights switch happens between two steps, so a step never mixes versions. It
writes the KV arena only while it holds the lease (its mapping is read-only before) and
checks the lease epoch before every step, so a fenced engine that was somehow still
running stops instead of writing.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

from belayer import faults
from belayer.rollout.procutil import (
    BACKGROUND_NICENESS,
    die_with_parent,
    engine_environment,
    memory_of,
    run_in_background,
    set_niceness,
)
from belayer.rollout.protocol import (
    AbortRequest,
    AddRequest,
    EngineReady,
    EngineSpec,
    Failed,
    HealthCheck,
    HealthResult,
    Heartbeat,
    LeaseTaken,
    MemoryReport,
    QueryMemory,
    Rejected,
    SketchResult,
    StepOutput,
    Stop,
    SwitchFailed,
    SwitchWeights,
    TakeLease,
    TokenDelta,
    VerifySketch,
    WeightsSwitched,
)


def engine_main(spec: EngineSpec, conn: Connection) -> None:
    """Entry point of an engine process (multiprocessing spawn target)."""
    die_with_parent()
    if spec.role == "shadow":
        if "shadow_start_fail" in faults.switched_on():
            faults.die_now()
        run_in_background()  # before torch starts its threads: they inherit the niceness
    os.environ.update(engine_environment(spec.threads))  # before vLLM loads (EngineLoop imports it)
    t0 = time.perf_counter()
    try:
        loop = EngineLoop(spec, conn)
    except Exception as exc:
        conn.send(Failed(f"engine ({spec.role}) failed to start: {type(exc).__name__}: {exc}"))
        return
    rss, private, _shared = memory_of(os.getpid())
    conn.send(
        EngineReady(os.getpid(), time.perf_counter() - t0, loop.digest, rss, private, loop.weights_version)
    )
    loop.run()


class EngineLoop:
    def __init__(self, spec: EngineSpec, conn: Connection):
        from belayer.rollout import (  # import cost: vLLM, ~15 s; only the engine process loads it, not the node
            shm,
            vllm_hooks,
        )

        self.spec, self.conn = spec, conn
        self.hooks = vllm_hooks
        self.arena = shm.ArenaMapping(spec.arena_path)
        vllm_hooks.bind_arena(self.arena)
        self.engine = vllm_hooks.build_engine(spec)
        self.faults = faults.switched_on()
        self.digest = vllm_hooks.device_digest()
        self.weights_version = spec.weights_version
        self.sketch = vllm_hooks.weights_sketch(self.engine)  # of weights the owner just verified
        self.next_position: dict[str, int] = {}  # engine request id -> position of its next token
        self.prompt_len: dict[str, int] = {}  # engine request id -> prompt tokens, until its first token
        self.tokens_streamed = 0
        self.last_sent = time.monotonic()
        self.running = True

    def run(self) -> None:
        while self.running:
            busy = self.arena.writable and self.engine.has_unfinished_requests()
            timeout = 0.0 if busy else self.spec.heartbeat_interval_s
            try:
                if self.conn.poll(timeout):
                    while self.running and self.conn.poll(0):
                        self.handle(self.conn.recv())
            except (EOFError, BrokenPipeError):  # supervisor gone: nothing to serve
                return
            if self.running and self.arena.writable and self.engine.has_unfinished_requests():
                self.step()
            if time.monotonic() - self.last_sent >= self.spec.heartbeat_interval_s:
                self.send(Heartbeat(time.time()))

    def handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self.add(msg)
        elif isinstance(msg, AbortRequest):
            self.engine.abort_request([msg.engine_request_id])
            self._forget(msg.engine_request_id)
        elif isinstance(msg, SwitchWeights):
            self.switch(msg)
        elif isinstance(msg, VerifySketch):
            t0 = time.perf_counter()
            ok = self.hooks.weights_sketch(self.engine) == self.sketch
            self.send(SketchResult(ok, time.perf_counter() - t0))
        elif isinstance(msg, TakeLease):
            self.take_lease()
        elif isinstance(msg, HealthCheck):
            t0 = time.perf_counter()
            # the fault targets the engine about to take over, so the fallback path is exercised
            fail = "device_check_fail" in self.faults and self.spec.role == "shadow"
            digest = self.hooks.device_digest(fail=fail)
            self.send(HealthResult(digest == msg.expected_digest, digest, time.perf_counter() - t0))
        elif isinstance(msg, QueryMemory):
            self.send(MemoryReport(*memory_of(os.getpid())))
        elif isinstance(msg, Stop):
            self.running = False

    def add(self, msg: AddRequest) -> None:
        if not self.arena.writable:
            self.send(Rejected(msg.engine_request_id, "engine does not hold the arena lease"))
            return
        self._fault("engine_crash_before_decode", lambda f: True)
        params = self.hooks.sampling_params(
            msg.spec, msg.max_tokens, len(msg.prompt_ids), msg.engine_request_id
        )
        try:
            self.engine.add_request(msg.engine_request_id, {"prompt_token_ids": list(msg.prompt_ids)}, params)
        except Exception as exc:  # vLLM's own validation: a non-retryable answer for this request
            self.send(Rejected(msg.engine_request_id, f"{type(exc).__name__}: {exc}"))
            return
        self.next_position[msg.engine_request_id] = len(msg.prompt_ids)
        self.prompt_len[msg.engine_request_id] = len(msg.prompt_ids)

    def switch(self, msg: SwitchWeights) -> None:
        """Compute with a newly sealed version from the next step on. The supervisor aborts or
        drains this engine's requests first, so nothing is scheduled across the switch."""
        t0 = time.perf_counter()
        if self.engine.has_unfinished_requests():
            self.send(SwitchFailed(msg.version, "requests still scheduled; abort or drain them first"))
            return
        if "publish_switch_fail" in self.faults and self.spec.role == "shadow":
            self.send(SwitchFailed(msg.version, "injected fault publish_switch_fail"))
            return
        background = self.spec.role == "shadow" and not self.arena.writable
        if background:  # a publish waits for the shadow too: switch at the node's priority
            set_niceness(self.spec.niceness)
        try:
            self.hooks.switch_weights(self.engine, msg.weights_path, self.spec.weight_mode)
            self.sketch = self.hooks.weights_sketch(self.engine)
        except Exception as exc:
            self.send(SwitchFailed(msg.version, f"{type(exc).__name__}: {exc}"))
            return
        finally:
            if background:
                set_niceness(BACKGROUND_NICENESS)
        self.weights_version = msg.version
        self.send(WeightsSwitched(msg.version, time.perf_counter() - t0))

    def take_lease(self) -> None:
        t0 = time.perf_counter()
        try:
            epoch = self.arena.try_take_lease()
            self.hooks.reset_worker_state(self.engine)
            if self.spec.role == "shadow":
                set_niceness(self.spec.niceness)
        except Exception as exc:
            self.send(Failed(f"lease not taken: {type(exc).__name__}: {exc}"))
            return
        self.send(LeaseTaken(epoch, time.perf_counter() - t0))

    def step(self) -> None:
        if not self.arena.still_leader():
            # Fenced: someone holds a newer epoch. Never write the arena again.
            os._exit(3)
        t0 = time.perf_counter()
        outputs = self.engine.step()
        prefilled = sum(self._prefilled(out) for out in outputs)
        deltas = [self._delta(out) for out in outputs]
        if deltas:
            self.send(StepOutput(deltas, time.perf_counter() - t0, self.weights_version, prefilled))
        self._fault("engine_crash_during_decode", lambda f: self.tokens_streamed >= f.number("after", 32))
        if self._armed("engine_hang", lambda f: self.tokens_streamed >= f.number("after", 32)):
            faults.hang_forever()

    def _prefilled(self, out) -> int:
        """Prompt tokens computed for `out`'s request, if this step gave its first token."""
        if out.request_id not in self.prompt_len:
            return 0
        return max(0, self.prompt_len.pop(out.request_id) - (out.num_cached_tokens or 0))

    def _delta(self, out) -> TokenDelta:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        position = self.next_position.get(out.request_id, 0)
        logprobs = self.hooks.take_logprobs(out.request_id, position, len(tokens))
        self.next_position[out.request_id] = position + len(tokens)
        if out.finished:
            self._forget(out.request_id)
        self.tokens_streamed += len(tokens)
        return TokenDelta(out.request_id, tokens, out.finished, completion.finish_reason, logprobs)

    def _forget(self, engine_request_id: str) -> None:
        self.next_position.pop(engine_request_id, None)
        self.prompt_len.pop(engine_request_id, None)
        self.hooks.forget_logprobs(engine_request_id)

    def send(self, msg) -> None:
        self.conn.send(msg)
        self.last_sent = time.monotonic()

    def _armed(self, name: str, condition) -> bool:
        fault = self.faults.get(name)
        return (
            fault is not None
            and self.spec.role == "primary"  # the node's first leader only: a replacement never re-faults
            and self.arena.epoch == int(fault.number("epoch", 1))
            and condition(fault)
        )

    def _fault(self, name: str, condition) -> None:
        if self._armed(name, condition):
            faults.die_now()
