"""The node's child processes (memory owner, engines): spawning, readiness, control calls,
fencing and stopping. Only the node's loop thread touches a child's pipe."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from belayer.rollout.config import RolloutConfig
from belayer.rollout.engine import engine_main
from belayer.rollout.errors import EngineStartError, RolloutError
from belayer.rollout.owner import owner_main
from belayer.rollout.protocol import (
    EngineReady,
    EngineSpec,
    Failed,
    OwnerReady,
    OwnerSpec,
    Stop,
)

MP = mp.get_context("spawn")  # never fork a process that may hold vLLM / OpenMP state
# How long a SIGKILLed child may take to exit before the wait gives up and says so.
REAP_TIMEOUT_S = 30.0
log = logging.getLogger("belayer.rollout")

Dispatch = Callable[["Child", Any], None]


@dataclass
class Child:
    role: str
    process: Any
    conn: Connection
    ready: Any = None  # EngineReady | OwnerReady once up
    last_heard: float = field(default_factory=time.monotonic)
    spec: Any = None
    version: int = 0  # engines: the weights version it computes with (confirmed by the engine)
    switching_to: int | None = None  # engines: a SwitchWeights sent, not answered yet
    switch_failed: bool = False  # engines: refused a switch; replaced, never asked again
    owner_generation: int = 0  # engines: the owner whose verified memory it loaded from

    @property
    def pid(self) -> int | None:
        return self.process.pid


def spawn_owner(config: RolloutConfig, model_dir: Path, generation: int, **adopt) -> Child:
    spec = OwnerSpec(
        node_id=config.node_id,
        generation=generation,
        model_dir=model_dir,
        dtype=config.dtype,
        kv_bytes=config.kv_cache_mb << 20,
        verify_interval_s=config.weights_verify_interval_s,
        **adopt,
    )
    return _spawn("owner", owner_main, spec, config.node_id)


def spawn_engine(
    config: RolloutConfig,
    model_dir: Path,
    weights: tuple[int, Path],
    arena_path: Path,
    owner_generation: int,
    role: str,
) -> Child:
    """An engine loading weights version `weights[0]` from the owner's segment `weights[1]`."""
    version, weights_path = weights
    spec = EngineSpec(
        node_id=config.node_id,
        role=role,
        model_dir=model_dir,
        weights_path=weights_path,
        arena_path=arena_path,
        dtype=config.dtype,
        weight_mode=config.weight_mode,
        kv_bytes=config.kv_cache_mb << 20,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        heartbeat_interval_s=config.heartbeat_interval_s,
        threads=config.engine_threads,
        weights_version=version,
        niceness=os.getpriority(os.PRIO_PROCESS, 0),
    )
    child = _spawn(role, engine_main, spec, config.node_id)
    child.owner_generation = owner_generation
    return child


def _spawn(role: str, target, spec, node_id: str) -> Child:
    parent, child = MP.Pipe()
    process = MP.Process(target=target, args=(spec, child), name=f"belayer-{node_id}-{role}", daemon=True)
    process.start()
    child.close()
    return Child(role, process, parent, spec=spec)


def on_ready(child: Child, msg: Any) -> bool:
    """Record a readiness message; True if `msg` was one."""
    if isinstance(msg, EngineReady):
        child.ready, child.version = msg, msg.weights_version
        return True
    if isinstance(msg, OwnerReady):
        child.ready = msg
        return True
    return False


def await_ready(child: Child, timeout_s: float, dispatch: Dispatch) -> None:
    """Block until `child` is ready, handing anything else it says to `dispatch`."""
    if child.ready is not None:
        return
    deadline = time.monotonic() + timeout_s
    while child.ready is None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise EngineStartError(
                f"{child.role} not ready after {timeout_s} s (rollout.engine_start_timeout_s)"
            )
        if not child.conn.poll(min(left, 0.5)):
            if not child.process.is_alive():
                raise EngineStartError(
                    f"{child.role} (pid {child.pid}) exited with {child.process.exitcode} while starting"
                )
            continue
        try:
            msg = child.conn.recv()
        except (EOFError, OSError):  # it died: its end of the pipe closed
            child.process.join(REAP_TIMEOUT_S)
            raise EngineStartError(
                f"{child.role} (pid {child.pid}) exited with {child.process.exitcode} while starting"
            ) from None
        if isinstance(msg, Failed):
            raise EngineStartError(msg.message)
        if not on_ready(child, msg):
            dispatch(child, msg)


def call(child: Child, msg: Any, reply_types: type | tuple, timeout_s: float, dispatch: Dispatch) -> Any:
    """Send a control message and wait for its reply, dispatching anything else."""
    child.conn.send(msg)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RolloutError(f"{child.role} did not answer {type(msg).__name__} in {timeout_s} s")
        try:
            if not child.conn.poll(left):
                continue
            reply = child.conn.recv()
        except (EOFError, OSError):
            raise RolloutError(f"{child.role} (pid {child.pid}) died during {type(msg).__name__}") from None
        if isinstance(reply, reply_types):
            return reply
        if isinstance(reply, Failed):
            raise RolloutError(reply.message)
        dispatch(child, reply)


def send(child: Child | None, msg: Any) -> None:
    """Best effort: a child that is gone (None, or a closed or broken pipe) is not an error
    here, because its death is handled through its sentinel; it is logged, never hidden."""
    if child is None:
        log.debug("no child to send %s to (role vacant, e.g. during a recovery)", type(msg).__name__)
        return
    try:
        child.conn.send(msg)
    except (OSError, ValueError) as exc:
        log.warning(
            "could not send %s to %s (pid %s): %s; its death is handled through its sentinel",
            type(msg).__name__,
            child.role,
            child.pid,
            exc,
        )


def drain(child: Child, dispatch: Dispatch) -> None:
    try:
        while child.conn.poll(0):
            dispatch(child, child.conn.recv())
    except (EOFError, OSError) as exc:
        log.info(
            "%s (pid %s) pipe closed while draining (%s); its death is handled through its sentinel",
            child.role,
            child.pid,
            type(exc).__name__,
        )


def fence(child: Child | None, timeout_s: float = REAP_TIMEOUT_S) -> None:
    """Kill and reap: once this returns the kernel has released the child's lease lock.
    Raises if the child outlives SIGKILL by `timeout_s` (stuck in the kernel): its lock may
    still be held, so nothing may take over its arena."""
    if child is None:
        return
    if child.process.is_alive():
        child.process.kill()
    _reap(child, timeout_s, "SIGKILL")


def close_conn(child: Child | None) -> None:
    if child is not None:
        try:
            child.conn.close()
        except OSError as exc:
            log.debug("closing the pipe of %s (pid %s): %s", child.role, child.pid, exc)


def stop(child: Child, grace_s: float = 5.0) -> None:
    """Ask a child to stop; SIGKILL it after `grace_s`; reap it (bounded)."""
    send(child, Stop())
    child.process.join(grace_s)
    if child.process.is_alive():
        log.warning("%s (pid %s) did not stop within %.0f s; killing it", child.role, child.pid, grace_s)
        child.process.kill()
        _reap(child, REAP_TIMEOUT_S, "SIGKILL")
    close_conn(child)


def _reap(child: Child, timeout_s: float, sent: str) -> None:
    child.process.join(timeout_s)
    if child.process.is_alive():
        raise RolloutError(
            f"{child.role} (pid {child.pid}) still alive {timeout_s:.0f} s after {sent} (stuck in the kernel, "
            "e.g. uninterruptible I/O); gave up waiting for it to exit"
        )
