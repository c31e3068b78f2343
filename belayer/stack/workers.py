"""Belayer's own Temporal workers as services of the local stack.

A worker is ready when Temporal lists it as a poller of its task queue: that is the
only signal that work sent to the queue will be picked up, so `belayer up` waits for
exactly that. Workers read the effective configuration `up` was given from a private
file (mode 0600; it holds credentials), so a worker never disagrees with `up`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

import tomli_w

from belayer.config import BelayerConfig, plain_dump
from belayer.stack import sandbox_hosts
from belayer.stack.process import ManagedProcess
from belayer.stack.services import Health, run_coroutine
from belayer.temporal_client import pollers
from belayer.workers.rollout.fleet import node_config
from belayer.workers.rollout.worker import node_task_queue

CONFIG_FILE_ENV = "BELAYER_CONFIG"


def write_effective_config(config: BelayerConfig, path: Path | None = None) -> Path:
    """The full configuration, secrets included, readable by the owner only; by default
    in the state directory, where the workers of that stack find it."""

    path = path or config.state_dir / "run" / "effective-config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(tomli_w.dumps(plain_dump(config, reveal_secrets=True)))
    return path


class WorkerService:
    """`python -m MODULE`, ready once it polls `task_queue` on Temporal."""

    def __init__(
        self,
        name: str,
        module: str,
        task_queue: str,
        queue_kind: str,
        config: BelayerConfig,
        *,
        startup_timeout_s: float | None = None,
        env: dict[str, str] | None = None,
    ):
        """`env`: set over the effective config for this worker only (a rollout node's id)."""
        self.name = name
        self.startup_timeout_s = startup_timeout_s
        self.env = env or {}
        self.module = module
        self.task_queue = task_queue
        self.queue_kind = queue_kind  # "workflow" or "activity"
        self.config = config
        self.process = ManagedProcess(name, config.state_dir)

    @property
    def address(self) -> str:
        return f"task queue {self.task_queue}"

    def ports(self) -> list[tuple[str, int]]:
        return []

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        env[CONFIG_FILE_ENV] = str(write_effective_config(self.config))
        env.setdefault("PYTHONUNBUFFERED", "1")
        return [sys.executable, "-m", self.module], env | self.env

    def ready(self) -> bool:
        return self.health().ok

    def health(self) -> Health:
        running = self.process.running()
        if running is None:
            return Health(False, "not running")
        try:
            seen = run_coroutine(
                lambda: pollers(
                    self.config.temporal, self.task_queue, self.queue_kind, self.config.storage.encryption_key
                ),
                timeout_s=5,
            )
        except Exception as exc:  # unhealthy with its reason
            return Health(False, f"cannot ask Temporal about {self.task_queue}: {exc}")
        mine = [identity for identity, _ in seen if identity.endswith(f":{running.pid}")]
        if not mine:
            return Health(False, f"not yet polling {self.task_queue}")
        return Health(True, f"polling {self.task_queue} as {mine[0]}")

    def after_ready(self) -> None:
        """Nothing: a worker needs no set-up once it polls."""


def rollout_service_name(k: int) -> str:
    """The stack's name of its k-th rollout node (from 0): rollout-node, rollout-node.1, ..."""
    return "rollout-node" + (f".{k}" if k else "")


class RolloutNodeService(WorkerService):
    """Rollout node k of this stack, with the node id `node_id` set in its environment
    (which wins over the effective config file every worker reads); `node_config` is its
    own configuration, for its status and for chaos aimed at it."""

    def __init__(self, config: BelayerConfig, k: int, node_id: str):
        self.node_config = node_config(config, node_id)
        super().__init__(
            rollout_service_name(k),
            "belayer.workers.rollout",
            node_task_queue(self.node_config),
            "activity",
            config,
            startup_timeout_s=config.rollout.engine_start_timeout_s,
            env={"BELAYER_ROLLOUT__NODE_ID": node_id},
        )


def sandbox_service_name(k: int) -> str:
    """The stack's name of its k-th sandbox host (from 0): sandbox-worker, sandbox-worker.1, ..."""
    return "sandbox-worker" + (f".{k}" if k else "")


class SandboxHostService(WorkerService):
    """Sandbox host k of this machine: the machine itself for k = 0, a host in namespaces
    of its own for k ≥ 1 (belayer/stack/sandbox_hosts.py says how separate)."""

    # `down` ends the whole stack: SIGINT stops the worker at once. SIGTERM would drain
    # it (belayer drain), moving its sandboxes to hosts that are going away too.
    stop_signal = signal.SIGINT

    def __init__(self, config: BelayerConfig, k: int):
        queue = sandbox_hosts.host_queue(config, k)
        super().__init__(
            sandbox_service_name(k),
            "belayer.workers.sandbox",
            queue,
            "activity",
            config,
            # importing the base image into a new host's storage comes first
            startup_timeout_s=max(config.stack.startup_timeout_s, 300.0) if k else None,
            env={"BELAYER_SANDBOX__HOST_TASK_QUEUE": queue} if k else None,
        )
        self.host_index = k

    def command(self) -> tuple[list[str], dict[str, str]]:
        argv, env = super().command()
        return (sandbox_hosts.launcher(self.host_index, argv) if self.host_index else argv), env


class LocalHttpCommand:
    """A `belayer` subcommand that serves HTTP on 127.0.0.1:`port`, reading the effective
    config file as the workers do; ready once `health` says so."""

    name: str
    subcommand: str

    def __init__(self, config: BelayerConfig, port: int):
        self.config = config
        self.port = port

    def ports(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", self.port)]

    def arguments(self) -> list[str]:
        return []

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        env[CONFIG_FILE_ENV] = str(write_effective_config(self.config))
        env.setdefault("PYTHONUNBUFFERED", "1")
        argv = [
            sys.executable,
            "-m",
            "belayer.cli",
            self.subcommand,
            "--port",
            str(self.port),
            *self.arguments(),
        ]
        return argv, env

    def ready(self) -> bool:
        return self.health().ok

    def health(self) -> Health:
        raise NotImplementedError

    def after_ready(self) -> None:
        """Nothing: its clients find it by its address."""


class EndpointService(LocalHttpCommand):
    """`belayer serve`: the OpenAI-compatible endpoint over agent sessions, on
    `stack.serve_port`; ready once it lists the model."""

    name, subcommand = "endpoint", "serve"

    def __init__(self, config: BelayerConfig):
        super().__init__(config, config.stack.serve_port)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1 (OpenAI-compatible, agent sessions)"

    def arguments(self) -> list[str]:
        return [arg for path in self.config.stack.serve_workloads for arg in ("--workload", str(path))]

    def health(self) -> Health:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=3) as response:
                models = [m["id"] for m in json.load(response)["data"]]
        except (OSError, ValueError, KeyError) as exc:
            return Health(False, f"does not answer GET /v1/models: {exc}")
        return Health(True, f"serves {', '.join(models)}")


class CodecServerService(LocalHttpCommand):
    """`belayer codec-server` for the local web UI, when payloads are encrypted.

    It reads the key from the same owner-only effective config file as the workers; ready
    once it answers the web UI's CORS preflight, which is the first thing the UI sends;
    the UI finds it through --ui-codec-endpoint.
    """

    name, subcommand = "codec-server", "codec-server"

    def __init__(self, config: BelayerConfig):
        super().__init__(config, config.temporal.codec_port)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port} (web UI codec endpoint)"

    def health(self) -> Health:
        ui_host = self.config.temporal.address.rpartition(":")[0] or "127.0.0.1"
        origin = f"http://{ui_host}:{self.config.temporal.ui_port}"
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/decode",
            method="OPTIONS",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        try:
            with urllib.request.urlopen(request, timeout=3) as response:
                allowed = response.headers.get("Access-Control-Allow-Origin")
        except OSError as exc:  # refused, timed out, or an HTTP error status
            return Health(False, f"does not answer the web UI's preflight: {exc}")
        if allowed != origin:
            return Health(False, f"answers, but not for the web UI origin {origin}")
        return Health(True, f"decodes payloads for the web UI at {origin}")
