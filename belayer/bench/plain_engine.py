"""A plain vLLM engine in a process of its own: the baseline the rollout benchmarks compare with.

This is vLLM the way users run it without Belayer: one spawned process holding an in-process
`vllm.LLMEngine` (VLLM_ENABLE_V1_MULTIPROCESSING=0, the node engines' environment), weights
read by vLLM's default safetensors loader from the model folder, its own KV cache. Engine
settings (dtype, eager mode, KV size, context, batch, prefix caching) match the node's engines,
so a difference in a benchmark comes from the recovery or publish path, not from tuning.

One deliberate exception: sampling goes through the node's position-seeded sampler (a vLLM
logits processor). vLLM's own per-request seeded generator restarts on a replay from prompt +
prefix and draws other tokens, so without it the baseline's replay could not be compared with
an unfailed run at all.

The parent side (`PlainEngine`) streams token deltas to a callback from a reader thread and
notices the child's death through its process sentinel, like the node supervisor does.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from belayer.rollout.procutil import die_with_parent, engine_environment, memory_of
from belayer.rollout.protocol import SamplingSpec

_MP = mp.get_context("spawn")  # never fork a process that may hold vLLM / OpenMP state
SAFETENSORS = "model.safetensors"

DeltaCallback = Callable[[str, list[int], bool], None]


@dataclass(frozen=True)
class PlainSpec:
    """How to build the engine; mirrors the node's `EngineSpec` minus shared memory."""

    model_dir: Path
    dtype: str
    kv_bytes: int
    max_model_len: int
    max_num_seqs: int
    threads: int = 0


# -- messages (parent -> child)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    max_tokens: int


@dataclass(frozen=True)
class _Reload:
    model_dir: Path


@dataclass(frozen=True)
class _Stop:
    pass


# -- messages (child -> parent)


@dataclass(frozen=True)
class _Ready:
    pid: int
    init_s: float


@dataclass(frozen=True)
class _Deltas:
    deltas: list[tuple[str, list[int], bool]]


@dataclass(frozen=True)
class _Reloaded:
    seconds: float


@dataclass(frozen=True)
class _Failed:
    message: str


class PlainEngineError(RuntimeError):
    """The plain engine failed to start, died unexpectedly or refused an operation."""


class PlainEngine:
    """Parent-side handle of one plain engine process. `start()`, `add()`, `kill()`, `close()`."""

    def __init__(self, spec: PlainSpec, on_delta: DeltaCallback):
        self.spec = spec
        self._on_delta = on_delta
        self._process = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()
        self._replies: queue.Queue = queue.Queue()
        self.failure: str | None = None
        self.ready_at: float | None = None
        self.init_s: float | None = None  # inside the child: imports + engine construction
        self.died_at: float | None = None
        self.dead = threading.Event()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> PlainEngine:
        parent, child = _MP.Pipe()
        self._process = _MP.Process(
            target=_engine_main, args=(self.spec, child), name="plain-vllm", daemon=True
        )
        self._process.start()
        child.close()
        self._conn = parent
        self._reader = threading.Thread(target=self._read_loop, name=f"plain-vllm-{self.pid}", daemon=True)
        self._reader.start()
        return self

    def wait_ready(self, timeout: float) -> float:
        """Block until the engine accepts work; returns the monotonic time it did."""
        if not self._ready.wait(timeout):
            raise PlainEngineError(f"plain engine (pid {self.pid}) not ready after {timeout} s")
        if self.ready_at is None:
            raise PlainEngineError(f"plain engine (pid {self.pid}) failed to start: {self.failure}")
        return self.ready_at

    def add(self, request_id: str, prompt_ids: list[int], spec: SamplingSpec, max_tokens: int) -> None:
        """Queue one request; its tokens arrive through `on_delta`."""
        self._conn.send(_Add(request_id, list(prompt_ids), spec, max_tokens))

    def reload(self, model_dir: Path, timeout: float) -> float:
        """vLLM's in-place weight reload from `model_dir`; returns the child's seconds."""
        self._conn.send(_Reload(Path(model_dir)))
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise PlainEngineError(f"weight reload not done after {timeout} s") from None
        if isinstance(reply, _Failed):
            raise PlainEngineError(reply.message)
        return reply.seconds

    def memory(self) -> tuple[int, int, int]:
        """(rss, private, shared) bytes of the engine process."""

        return memory_of(self.pid)

    def kill(self) -> None:
        """The injected fault: SIGKILL, as a crash or the OOM killer would."""
        os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if self._process is None:
            return
        if self._process.is_alive():
            try:
                self._conn.send(_Stop())
            except (OSError, ValueError):
                pass
            self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        if self._reader is not None:
            self._reader.join(5)
        self._conn.close()

    def _read_loop(self) -> None:
        eof = False
        while True:
            ready = wait([self._process.sentinel] if eof else [self._conn, self._process.sentinel])
            if self._process.sentinel in ready:
                self.died_at = time.monotonic()
                while self._receive_one():  # tokens it streamed before dying are real: deliver them
                    pass
                self.failure = self.failure or f"exited with {self._process.exitcode}"
                self._ready.set()
                self._replies.put(_Failed(f"plain engine (pid {self.pid}) {self.failure}"))
                self.dead.set()
                return
            eof = not self._receive_one()

    def _receive_one(self) -> bool:
        """Dispatch one waiting message; False when none is waiting or the pipe is closed."""
        try:
            if not self._conn.poll(0):
                return False
            self._dispatch(self._conn.recv())
            return True
        except (EOFError, OSError):
            return False

    def _dispatch(self, msg) -> None:
        if isinstance(msg, _Deltas):
            for request_id, token_ids, finished in msg.deltas:
                self._on_delta(request_id, token_ids, finished)
        elif isinstance(msg, _Ready):
            self.ready_at, self.init_s = time.monotonic(), msg.init_s
            self._ready.set()
        elif isinstance(msg, _Failed):
            self.failure = msg.message
            self._ready.set()
            self._replies.put(msg)
        elif isinstance(msg, _Reloaded):
            self._replies.put(msg)


# ----------------------------------------------------------------------------- child side


def _engine_main(spec: PlainSpec, conn: Connection) -> None:
    """Entry point of the engine process: the node engines' environment, then a serve loop."""
    t0 = time.perf_counter()
    die_with_parent()
    os.environ.update(engine_environment(spec.threads))  # before vLLM loads (_build imports it)
    try:
        engine = _build(spec)
    except Exception as exc:
        conn.send(_Failed(f"plain engine failed to start: {type(exc).__name__}: {exc}"))
        return
    conn.send(_Ready(os.getpid(), time.perf_counter() - t0))
    _serve(engine, conn)


def _build(spec: PlainSpec):
    from vllm import EngineArgs  # import cost: vLLM, ~15 s
    from vllm.v1.engine.llm_engine import LLMEngine  # import cost: vLLM, ~15 s

    from belayer.rollout.vllm_hooks import PositionSeededSampler  # import cost: vLLM, ~15 s

    args = EngineArgs(
        model=str(spec.model_dir),
        dtype=spec.dtype,
        enforce_eager=True,
        kv_cache_memory_bytes=spec.kv_bytes,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        seed=0,
        disable_log_stats=True,
        enable_prefix_caching=True,
        logits_processors=[PositionSeededSampler],
    )
    return LLMEngine.from_engine_args(args)


def _serve(engine, conn: Connection) -> None:
    from belayer.rollout.vllm_hooks import sampling_params  # import cost: vLLM, ~15 s

    while True:
        busy = engine.has_unfinished_requests()
        try:
            if conn.poll(0 if busy else 0.05):
                msg = conn.recv()
                if isinstance(msg, _Stop):
                    return
                if isinstance(msg, _Add):
                    params = sampling_params(
                        msg.spec, msg.max_tokens, len(msg.prompt_ids), request_id=msg.request_id
                    )
                    engine.add_request(msg.request_id, {"prompt_token_ids": msg.prompt_ids}, params)
                elif isinstance(msg, _Reload):
                    conn.send(_reload(engine, msg.model_dir))
                continue
        except (EOFError, BrokenPipeError):
            return
        if busy:
            outputs = engine.step()
            deltas = [(o.request_id, list(o.outputs[0].token_ids), o.finished) for o in outputs]
            if deltas:
                conn.send(_Deltas(deltas))


def _reload(engine, model_dir: Path):
    """vLLM's own in-place path: the worker re-reads the checkpoint and re-runs its weight
    processing (oneDNN repacking on CPU); the prefix cache holds KV of the old weights."""
    t0 = time.perf_counter()
    try:
        engine.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(model_dir), "is_checkpoint_format": True}
        )
        engine.reset_prefix_cache()
    except Exception as exc:
        return _Failed(f"weight reload failed: {type(exc).__name__}: {exc}")
    return _Reloaded(time.perf_counter() - t0)


# ----------------------------------------------------------------------------- weight files


def warm_page_cache(model_dir: Path) -> int:
    """Read the weights file once so the baseline's load hits the page cache, as a restart on
    a host that just ran the same model would; returns the bytes read."""
    total = 0
    with open(Path(model_dir) / SAFETENSORS, "rb") as f:
        while chunk := f.read(16 << 20):
            total += len(chunk)
    return total


def parameter_count(model_dir: Path) -> int:
    """Parameters in the safetensors file, from its header alone."""
    with open(Path(model_dir) / SAFETENSORS, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
