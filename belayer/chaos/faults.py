"""Real faults against a running local stack: processes SIGKILLed, servers stopped,
containers killed. Nothing here sets a flag that pretends.

Each fault names its target, does it, and returns a `FaultReport`. Where something must
come back (a worker the stack supervises), the fault restarts it the way a cluster
supervisor would, after the kill, and says so.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Literal

import psutil
from pydantic import BaseModel

from belayer.config import BelayerConfig
from belayer.errors import BelayerError
from belayer.rollout.identity import cleanup_node
from belayer.rollout.status import NodeStatus
from belayer.sandbox.backend import SandboxBackend
from belayer.stack import sandbox_hosts
from belayer.stack.local import LocalStack
from belayer.stack.workers import RolloutNodeService, sandbox_service_name
from belayer.workers.rollout.worker import node_task_queue
from belayer.workers.rollout.worker import read_roles as node_roles  # noqa: F401 (the chaos modules' name)

FaultKind = Literal[
    "engine-crash",
    "engine-hang",
    "owner-crash",
    "node-crash",
    "sandbox-crash",
    "sandbox-host-crash",
    "temporal-worker-crash",
    "temporal-restart",
    "s3-outage",
]
FAULT_KINDS: tuple[str, ...] = FaultKind.__args__
# A training run also has a trainer to lose (`belayer train --chaos`).
TRAINING_FAULT_KINDS: tuple[str, ...] = (*FAULT_KINDS, "trainer-crash")

# What recovers each fault kind, as `belayer run --chaos`, `belayer train --chaos` and the
# soak name it where their records show nothing more specific (a node's own recovery
# record, a trajectory's restore and where it came from).
RECOVERED_BY: dict[str, str] = {
    "engine-crash": "takeover",
    "engine-hang": "takeover",
    "owner-crash": "a new owner adopting the weights",
    "node-crash": "temporal retry on another node or the restarted one (same weights version)",
    "sandbox-crash": "restore+replay",
    "sandbox-host-crash": "restore+replay",
    "temporal-worker-crash": "workflow replay on a restarted worker",
    "temporal-restart": "Temporal persistence",
    "s3-outage": "retries with backoff",
    "trainer-crash": "train step retried on the restarted trainer from its last checkpoint",
    "terminate": "the host's reaper removed its sandbox",
    "drain": "moved to another host",
}


class ChaosError(BelayerError):
    """A fault could not be injected (its target is missing)."""


class FaultReport(BaseModel):
    kind: str
    target: str
    at: float  # time.time() of the injection
    detail: str


class Chaos:
    """Fault injection against the stack of one state directory."""

    def __init__(self, config: BelayerConfig):
        self.config = config
        self.stack = LocalStack(config)

    def inject(
        self,
        kind: str,
        *,
        sandbox_container: str | None = None,
        duration_s: float = 5.0,
        node: str | None = None,
        node_queue: str | None = None,
        host: str | None = None,
    ) -> FaultReport:
        """`node`: the rollout node id a node fault hits (engine, owner, node), or
        `node_queue`, the queue of the node serving the target trajectory; by default the
        stack's first node. `host`: the sandbox host sandbox-host-crash hits; by default the
        one holding `sandbox_container`, else the first."""
        node = node or self._node_serving(node_queue)
        handlers: dict[str, Callable[[], tuple[str, str]]] = {
            "engine-crash": lambda: self._signal_role("leader", signal.SIGKILL, node),
            "engine-hang": lambda: self._signal_role("leader", signal.SIGSTOP, node),
            "owner-crash": lambda: self._signal_role("owner", signal.SIGKILL, node),
            "node-crash": lambda: self._crash_node(node),
            "sandbox-crash": lambda: self._kill_container(sandbox_container),
            "sandbox-host-crash": lambda: self._crash_sandbox_host(sandbox_container, host),
            "temporal-worker-crash": lambda: self._crash_service("trajectory-worker"),
            "temporal-restart": lambda: self._outage("temporal", 1.0),
            "s3-outage": lambda: self._outage("seaweedfs", duration_s),
            "trainer-crash": lambda: self._crash_service("trainer-worker"),
        }
        if kind not in handlers:
            raise ChaosError(f"unknown fault {kind!r}; choose one of {', '.join(TRAINING_FAULT_KINDS)}")
        at = time.time()
        target, detail = handlers[kind]()
        return FaultReport(kind=kind, target=target, at=at, detail=detail)

    # -- rollout node -------------------------------------------------------------------

    def node_config(self, node: str | None) -> BelayerConfig:
        """The configuration of the stack's rollout node `node` (its first when None)."""
        nodes = self.stack.rollout_node_configs()
        if node is None:
            return nodes[0]
        for config in nodes:
            if config.rollout.node_id == node:
                return config
        raise ChaosError(
            f"no rollout node {node!r} in this stack; its nodes are "
            f"{', '.join(c.rollout.node_id for c in nodes)}"
        )

    def _node_serving(self, node_queue: str | None) -> str | None:
        return next(
            (
                c.rollout.node_id
                for c in self.stack.rollout_node_configs()
                if node_queue and node_task_queue(c) == node_queue
            ),
            None,
        )

    def roles(self, node: str | None = None) -> NodeStatus:
        roles = node_roles(self.node_config(node))
        if roles is None:
            raise ChaosError("no rollout node roles: is the rollout node up (`belayer up`)?")
        return roles

    def _signal_role(self, role: str, sig: int, node: str | None = None) -> tuple[str, str]:
        pid = getattr(self.roles(node), role)
        if not pid:
            raise ChaosError(f"the rollout node has no {role} right now")
        os.kill(pid, sig)
        return f"{role} pid {pid}", f"sent {signal.Signals(sig).name}"

    def _crash_node(self, node: str | None) -> tuple[str, str]:
        """The node's supervisor and its engines and owner die together. With one node it
        comes back at once, as a supervisor would restart it; with several it is lost and
        stays down, so its turns move to another node (`belayer up` brings it back)."""
        node_id = self.node_config(node).rollout.node_id
        service = next(
            s
            for s in self.stack.services
            if isinstance(s, RolloutNodeService) and s.node_config.rollout.node_id == node_id
        )
        return self._crash_service(service.name, restart=self.stack.rollout_nodes == 1)

    # -- processes the stack supervises --------------------------------------------------

    def _service(self, name: str):
        for service in self.stack.services:
            if service.name == name:
                return service
        raise ChaosError(f"no component {name!r} in this stack")

    def _crash_service(
        self, name: str, while_down: Callable[[], str] | None = None, restart: bool = True
    ) -> tuple[str, str]:
        """SIGKILL a supervised process and its children, then restart it like a supervisor
        (unless told it is lost for good)."""
        service = self._service(name)
        proc = self.stack.process(service).running()
        if proc is None:
            raise ChaosError(f"{name} is not running; start it with `belayer up`")
        family = [proc, *proc.children(recursive=True)]
        sandbox_hosts.kill_all(family)
        detail = f"SIGKILLed with {len(family) - 1} children"
        if isinstance(service, RolloutNodeService):
            cleanup_node(service.node_config.rollout.node_id)
        if while_down is not None:
            detail += "; " + while_down()
        if not restart:
            return f"{name} pid {proc.pid}", detail + "; left down"
        self.stack._start_one(service, lambda _m: None, wait=True)
        return f"{name} pid {proc.pid}", detail + "; restarted"

    def _outage(self, name: str, duration_s: float) -> tuple[str, str]:
        service = self._service(name)
        proc = self.stack.process(service).running()
        if proc is None:
            raise ChaosError(f"{name} is not running; start it with `belayer up`")
        _kill(proc)
        proc.wait(timeout=30)
        time.sleep(duration_s)
        self.stack._start_one(service, lambda _m: None, wait=True)
        return f"{name} pid {proc.pid}", f"SIGKILLed, down {duration_s:.1f}s, restarted"

    # -- sandboxes ----------------------------------------------------------------------

    def _kill_container(self, container: str | None) -> tuple[str, str]:
        if not container:
            raise ChaosError("sandbox-crash needs a target container (the trajectory's sandbox)")
        backend = self._backend_on(self._host_of(container))
        if not backend.is_running(container):
            raise ChaosError(f"container {container} is not running: nothing to kill")
        backend.kill(container)
        return f"container {container}", f"{backend.name} kill (SIGKILL to every process in it)"

    def container_gone(self, container: str) -> bool:
        """Whether `container` no longer runs (its trajectory ended and destroyed it)."""
        k = sandbox_hosts.host_of_container(self.config, self.stack.sandbox_hosts, container)
        backend = None if k is None else sandbox_hosts.backend_on(self.config, k)
        return backend is None or not backend.is_running(container)

    def _backend_on(self, k: int) -> SandboxBackend:
        """The sandbox backend as host k sees it."""
        backend = sandbox_hosts.backend_on(self.config, k)
        if backend is None:
            raise ChaosError(f"sandbox host {sandbox_hosts.host_name(k)} is not running")
        return backend

    def _host_of(self, container: str) -> int:
        """The host holding `container`: the machine itself when the stack has one host."""
        if self.stack.sandbox_hosts == 1:
            return 0
        k = sandbox_hosts.host_of_container(self.config, self.stack.sandbox_hosts, container)
        if k is None:
            raise ChaosError(f"no sandbox host of this stack holds container {container}")
        return k

    def _crash_sandbox_host(self, container: str | None, host: str | None = None) -> tuple[str, str]:
        """The host's worker and every sandbox container on it die together. With one host,
        the host comes back at once (its disk kept), as a supervisor would restart it. With
        several, the host holding `container` (or the first) is lost for good: its disk is
        wiped and it stays down, so its trajectories recover on another host from the object
        store; `belayer up` brings it back, empty."""
        if host is not None:
            k = self.stack.sandbox_host(host).host_index
        else:
            k = self._host_of(container) if container else 0
        name = sandbox_service_name(k)

        def kill_containers() -> str:
            backend = self._backend_on(k)
            running = [c for c in sandbox_hosts.containers_on(self.config, k) if backend.is_running(c)]
            for container in running:
                backend.kill(container)
            return f"{len(running)} containers killed"

        if self.stack.sandbox_hosts == 1:
            return self._crash_service(name, while_down=kill_containers)
        worker = self.stack.process(self._service(name)).running()
        if worker is None:
            raise ChaosError(f"{name} is not running; start it with `belayer up`")
        if k == 0:  # the machine itself: its worker and its sandboxes go, the machine stays
            _kill(worker)
            backend = self._backend_on(0)
            removed = [name for sandbox_id in backend.lineages() for name in backend.fence(sandbox_id)]
            detail = f"worker SIGKILLed, {len(removed)} containers killed and removed"
        else:
            ended = sandbox_hosts.end(self.config, k)
            sandbox_hosts.wipe(self.config, k)
            detail = f"{ended} processes SIGKILLed (worker, podman, sandboxes), its storage wiped"
        return f"sandbox host {sandbox_hosts.host_name(k)} ({name} pid {worker.pid})", detail + "; left down"


def _kill(proc: psutil.Process) -> None:
    try:
        proc.kill()
    except psutil.Error:
        pass
