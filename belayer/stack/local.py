"""`belayer up | down | status`: the local stack as one unit.

`up` starts what is not running, in order, waits for each to answer, and on any failure
stops exactly what this call started, so a failed `up` leaves nothing behind. `down`
stops exactly what `up` recorded in its pid files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import psutil

from belayer.config import BelayerConfig
from belayer.errors import StackError
from belayer.rollout.identity import cleanup_node
from belayer.sandbox.backends import open_backend
from belayer.sandbox.runtime import run_podman
from belayer.stack import sandbox_hosts
from belayer.stack.process import ManagedProcess
from belayer.stack.services import Health, SeaweedFS, TemporalDevServer, port_in_use
from belayer.stack.workers import (
    CodecServerService,
    EndpointService,
    RolloutNodeService,
    SandboxHostService,
    WorkerService,
    rollout_service_name,
    sandbox_service_name,
)
from belayer.workers.rollout.fleet import node_config, recorded_topology, rollout_node_ids, topology_file
from belayer.workers.rollout.worker import describe_roles, read_roles, roles_file


class Service(Protocol):
    name: str

    @property
    def address(self) -> str: ...
    def ports(self) -> list[tuple[str, int]]: ...
    def command(self) -> tuple[list[str], dict[str, str]]: ...
    def ready(self) -> bool: ...
    def health(self) -> Health: ...
    def after_ready(self) -> None: ...


@dataclass
class ComponentStatus:
    """One line of `belayer status`."""

    name: str
    pid: int | None
    address: str
    healthy: bool
    detail: str
    log: str | None


Reporter = Callable[[str], None]


class LocalStack:
    """The services of one state directory."""

    def __init__(
        self, config: BelayerConfig, rollout_nodes: int | None = None, sandbox_hosts: int | None = None
    ):
        """`rollout_nodes`, `sandbox_hosts`: how many `up` starts; by default as many as the
        running stack was started with (`up --rollout-nodes --sandbox-hosts`), else
        `stack.rollout_nodes` and `stack.sandbox_hosts`."""
        self.config = config
        self.state_dir = config.state_dir
        self.topology_file = topology_file(self.state_dir)
        self.recorded = recorded_topology(self.state_dir)
        self.rollout_nodes = rollout_nodes or self.recorded.get("rollout_nodes") or config.stack.rollout_nodes
        self.sandbox_hosts = sandbox_hosts or self.recorded.get("sandbox_hosts") or config.stack.sandbox_hosts
        self.services: list[Service] = [
            TemporalDevServer(config.temporal, self.state_dir),
            SeaweedFS(config.storage, config.stack, self.state_dir),
            *belayer_workers(config, self.rollout_nodes, self.sandbox_hosts),
        ]
        if config.stack.serve_port:
            self.services.append(EndpointService(config))
        if config.temporal.encrypt_payloads:
            # Started with the stack so the web UI, pointed at it, shows payloads decoded.
            self.services.insert(1, CodecServerService(config))

    def select(self, names: list[str] | None) -> None:
        """Keep only the named services (for `up --only`); unknown names are an error."""
        if not names:
            return
        known = [s.name for s in self.services]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise StackError(f"unknown component(s) {', '.join(unknown)}; choose from {', '.join(known)}")
        self.services = [s for s in self.services if s.name in names]

    def sandbox_host(self, name: str) -> SandboxHostService:
        """The sandbox host called `name`: its host name, service name or task queue."""
        hosts = [s for s in self.services if isinstance(s, SandboxHostService)]
        for service in hosts:
            if name in (service.name, service.task_queue, sandbox_hosts.host_name(service.host_index)):
                return service
        known = ", ".join(f"{sandbox_hosts.host_name(s.host_index)} ({s.name})" for s in hosts)
        raise StackError(f"no sandbox host {name!r} in this stack; its hosts are: {known}")

    def process(self, service: Service) -> ManagedProcess:
        return ManagedProcess(service.name, self.state_dir)

    def up(self, report: Reporter = lambda _msg: None, wait: bool = True) -> list[str]:
        """Start every service that is not running; returns the names started."""
        self._refuse_fewer("rollout_nodes", "rollout nodes", rollout_service_name)
        self._refuse_fewer("sandbox_hosts", "sandbox hosts", sandbox_service_name)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.topology_file.parent.mkdir(parents=True, exist_ok=True)
        self.topology_file.write_text(
            json.dumps({"rollout_nodes": self.rollout_nodes, "sandbox_hosts": self.sandbox_hosts})
        )
        started: list[Service] = []
        try:
            for service in self.services:
                if self._start_one(service, report, wait):
                    started.append(service)
        except BaseException:
            for service in reversed(started):
                self.process(service).stop()
            raise
        return [s.name for s in started]

    def _start_one(self, service: Service, report: Reporter, wait: bool) -> bool:
        proc = self.process(service)
        if proc.running() is not None:
            report(f"{service.name}: already running (pid {proc.running().pid})")
            if wait:
                self._wait_ready(service, proc, report)
                service.after_ready()
            return False
        self._refuse_taken_ports(service)
        argv, env = service.command()
        pid = proc.start(argv, env)
        report(f"{service.name}: started (pid {pid}), log {proc.log_file}")
        if wait:
            try:
                self._wait_ready(service, proc, report)
                service.after_ready()
            except BaseException:
                proc.stop()
                raise
        return True

    def _refuse_taken_ports(self, service: Service) -> None:
        for host, port in service.ports():
            if port_in_use(host, port):
                raise StackError(
                    f"{service.name} cannot start: {host}:{port} is already in use by "
                    f"{_who_listens(port)}. Stop that process, or move Belayer's "
                    f"{service.name} to other ports ({_port_setting_hint(service.name)})."
                )

    def _wait_ready(self, service: Service, proc: ManagedProcess, report: Reporter) -> None:
        timeout = getattr(service, "startup_timeout_s", None) or self.config.stack.startup_timeout_s
        deadline = time.monotonic() + timeout
        report(f"{service.name}: waiting until it answers (timeout {timeout:.0f}s)")
        while time.monotonic() < deadline:
            if proc.running() is None:
                raise StackError(
                    f"{service.name} exited during start-up; its log is {proc.log_file}:\n{proc.log_tail()}"
                )
            if service.ready():
                report(f"{service.name}: ready at {service.address}")
                return
            time.sleep(0.2)
        raise StackError(
            f"{service.name} did not answer within {timeout:.0f}s (raise "
            f"BELAYER_STACK__STARTUP_TIMEOUT_S if the machine is slow); its log is "
            f"{proc.log_file}:\n{proc.log_tail()}"
        )

    def down(self, report: Reporter = lambda _msg: None) -> list[str]:
        """Stop what `up` started: Belayer's workers, then the services they use; returns
        the names stopped. The members of a layer stop together: each takes its time to
        shut down gracefully (SeaweedFS 3.7 s, Temporal 3 s here: 6.7 s one after the other)."""
        workers = [s for s in reversed(self.services) if isinstance(s, WorkerService)]
        servers = [s for s in reversed(self.services) if not isinstance(s, WorkerService)]
        stopped = []
        for layer in (workers, servers):
            with ThreadPoolExecutor(max_workers=max(len(layer), 1)) as pool:
                outcomes = list(pool.map(self._stop, layer))
            for service, (was_running, ended) in zip(layer, outcomes, strict=True):
                report(f"{service.name}: {'stopped' if was_running else 'was not running'}")
                stopped += [service.name] if was_running else []
                if ended:
                    report(f"{service.name}: ended {ended} processes of its sandboxes")
        self._remove_rollout_leftovers(report)
        self._end_orphaned_monitors(report)
        self.topology_file.unlink(missing_ok=True)
        return stopped

    def _end_orphaned_monitors(self, report: Reporter) -> None:
        """A container monitor (conmon) of this stack's podman storage whose container does
        not run: debris of a podman call killed half-way (a worker SIGKILLed while it created
        or restored a sandbox), its container forgotten or left created, never started.
        Nothing else would ever end it."""
        for proc in orphaned_monitors(self.state_dir):
            with contextlib.suppress(psutil.Error):
                proc.kill()
            report(f"ended container monitor pid {proc.pid} of a container that does not run")

    def _refuse_fewer(self, key: str, what: str, service_name: Callable[[int], str]) -> None:
        """Starting fewer than run now would leave the others running, unknown to `down`."""
        wanted, recorded = getattr(self, key), self.recorded.get(key, 0)
        if any(ManagedProcess(service_name(k), self.state_dir).running() for k in range(wanted, recorded)):
            raise StackError(
                f"the stack runs {recorded} {what}; `belayer down` first to start it with {wanted}"
            )

    def rollout_node_configs(self) -> list[BelayerConfig]:
        """The configuration each of the stack's rollout nodes runs with."""
        return [
            node_config(self.config, node_id) for node_id in rollout_node_ids(self.config, self.rollout_nodes)
        ]

    def _stop(self, service: Service) -> tuple[bool, int]:
        """Stop one service: whether it was running, and how many processes of its sandboxes
        were ended with it (a sandbox host of its own goes with everything on it)."""
        was_running = self.process(service).stop(sig=getattr(service, "stop_signal", signal.SIGTERM))
        host_index = getattr(service, "host_index", 0)
        return was_running, sandbox_hosts.end(self.config, host_index) if host_index else 0

    def _remove_rollout_leftovers(self, report: Reporter) -> None:
        """A rollout node killed hard cannot unlink its shared memory: `down` does."""

        for config in self.rollout_node_configs():
            for segment in cleanup_node(config.rollout.node_id):
                report(f"rollout node {config.rollout.node_id}: removed leftover shared memory {segment}")
            roles_file(config).unlink(missing_ok=True)

    def status(self) -> list[ComponentStatus]:
        rows = [self._service_status(service) for service in self.services]
        rows.append(sandbox_runtime_status(self.config))
        return self._flag_other_versions(rows)

    def _flag_other_versions(self, rows: list[ComponentStatus]) -> list[ComponentStatus]:
        """One stack serves one policy: a running node on an older version than another is
        flagged (between a publish's first and last node, or a node that missed one)."""
        nodes = [s for s in self.services if isinstance(s, RolloutNodeService)]
        versions = {s.name: roles.weights_version for s in nodes
                    if self.process(s).running() and (roles := read_roles(s.node_config)) is not None}  # fmt: skip
        flags = other_version_flags(versions)
        return [
            replace(row, detail=f"{row.detail}; {flags[row.name]}") if row.name in flags else row
            for row in rows
        ]

    def _service_status(self, service: Service) -> ComponentStatus:
        proc = self.process(service)
        running = proc.running()
        if running is None:
            health = Health(False, "not running (start it with `belayer up`)")
        else:
            health = service.health()
        detail = health.detail
        if isinstance(service, RolloutNodeService) and running is not None:
            detail += "; " + describe_roles(read_roles(service.node_config))
        return ComponentStatus(
            name=service.name,
            pid=running.pid if running else None,
            address=service.address,
            healthy=health.ok,
            detail=detail,
            log=str(proc.log_file),
        )


def belayer_workers(
    config: BelayerConfig, rollout_nodes: int = 1, sandbox_hosts: int = 1
) -> list[WorkerService]:
    """Belayer's own workers: sandbox hosts (root only: CRIU), rollout nodes, trajectories, trainer.

    The first rollout node is the service `rollout-node`; node k of more is `rollout-node.k`,
    with the node id `<rollout.node_id>.k`."""
    workers: list[WorkerService] = []
    if os.geteuid() == 0:
        workers += [SandboxHostService(config, k) for k in range(sandbox_hosts)]
    workers += [
        RolloutNodeService(config, k, node_id)
        for k, node_id in enumerate(rollout_node_ids(config, rollout_nodes))
    ]
    workers.append(
        WorkerService(
            "trajectory-worker",
            "belayer.workers.trajectory",
            config.temporal.workflow_task_queue,
            "workflow",
            config,
        )
    )
    workers.append(
        WorkerService(
            "trainer-worker",
            "belayer.workers.trainer",
            config.trainer.task_queue,
            "activity",
            config,
        )
    )
    return workers


def sandbox_runtime_status(config: BelayerConfig) -> ComponentStatus:
    """The sandbox backend's runtime on this host (for podman: podman + runc + CRIU + base
    image): not a process, but `status` must show it."""
    health = open_backend(config.sandbox, config.state_dir, config.cache_dir).health()
    return ComponentStatus(
        name="sandbox-runtime",
        pid=None,
        address=health.storage,
        healthy=health.ok,
        detail=health.summary if health.ok else "; ".join(health.problems),
        log=None,
    )


def root_warning() -> str | None:
    """What a non-root user must know before relying on checkpoints."""
    if os.geteuid() == 0:
        return None
    return (
        "not running as root: checkpoint and restore of sandboxes need root (CRIU), so they "
        "are unavailable. Temporal, S3 storage, rollout engines and sandboxes without "
        "checkpoints still work; run `sudo belayer up` for full recovery."
    )


def _who_listens(port: int) -> str:
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid:
                    name = psutil.Process(conn.pid).name()
                    return f"another process (pid {conn.pid}, {name})"
    except psutil.Error:
        pass
    return "another process"


def _port_setting_hint(name: str) -> str:
    if name == "temporal":
        return "BELAYER_TEMPORAL__ADDRESS, BELAYER_TEMPORAL__UI_PORT"
    if name == "codec-server":
        return "BELAYER_TEMPORAL__CODEC_PORT"
    if name == "endpoint":
        return "BELAYER_STACK__SERVE_PORT; 0 starts none"
    return "BELAYER_STORAGE__ENDPOINT and BELAYER_STACK__SEAWEEDFS_*_PORT"


def status_as_dicts(rows: list[ComponentStatus]) -> list[dict]:
    return [asdict(row) for row in rows]


def other_version_flags(versions: dict[str, int]) -> dict[str, str]:
    """node -> why it is flagged, for every node behind the newest version a node serves."""
    newest = max(versions.values(), default=None)
    return {
        name: f"SERVES v{version}, ANOTHER NODE v{newest}: a publish still going on, or one it missed "
        "(a node started again comes up on the stack's weights)"
        for name, version in versions.items()
        if version != newest
    }


def orphaned_monitors(state_dir: Path) -> list[psutil.Process]:
    """The conmon processes of the podman storage under `state_dir` whose container is not
    running (podman does not know it, or it was created and never started); none when
    podman cannot answer: then nothing is known to be orphaned."""
    storage = str(state_dir / "podman")
    monitors = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if proc.info["name"] == "conmon" and storage in " ".join(argv) and "-c" in argv[:-1]:
            monitors[argv[argv.index("-c") + 1]] = proc
    if not monitors:
        return []
    listed = run_podman("ps", "--no-trunc", "--format", "{{.ID}}", state_dir=state_dir, timeout=60)
    if listed.returncode != 0:
        return []
    running = set(listed.stdout.split())
    return [proc for container, proc in monitors.items() if container not in running]
