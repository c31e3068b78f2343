"""The sandbox-backend registry: `sandbox.backend` names a registered backend or is refused,
and the backend it names is the one the sandbox host, the stack and its status, chaos
(through the stack's sandbox hosts) and the sandbox worker's host check all get; chaos
finds, kills and counts real podman containers through it.

The second backend here is a test double registered for the test only: it keeps its
containers in a dict and records every call, so what the real `SandboxHost` and the
stack's functions ask of it can be checked without podman."""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer.chaos.faults import Chaos, ChaosError
from belayer.chaos.leaks import sandbox_containers
from belayer.config import load_config
from belayer.errors import ConfigError
from belayer.sandbox import backends, lineage, runtime
from belayer.sandbox.backend import BackendHealth
from belayer.sandbox.host import make_host
from belayer.sandbox.localstore import LocalDirStore
from belayer.stack import sandbox_hosts
from belayer.stack.local import sandbox_runtime_status
from belayer.workers.sandbox.worker import check_host


class RecordingBackend:
    """Containers in a dict ({name: (sandbox id, running)}); every call in `calls`."""

    name = "recording"

    def __init__(self, cfg, state_dir, cache_dir=None, *, command_prefix=()):
        self.opened_with = (cfg, state_dir, cache_dir, command_prefix)
        self.containers: dict[str, tuple[str, bool]] = {}
        self.calls: list[tuple] = []

    def start(self, sandbox_id: str, generation: int) -> str:
        """A container of the lineage, as if the engine had started it before this host did."""
        name = self.container_name(sandbox_id, generation)
        self.containers[name] = (sandbox_id, True)
        return name

    def container_name(self, sandbox_id: str, generation: int) -> str:
        return f"{sandbox_id}-g{generation}"

    def channel_path(self, sandbox_id: str) -> Path:
        return Path("/nonexistent") / sandbox_id / "supervisor.sock"

    def lineages(self) -> dict[str, list[str]]:
        self.calls.append(("lineages",))
        found: dict[str, list[str]] = {}
        for name, (sandbox_id, _) in self.containers.items():
            found.setdefault(sandbox_id, []).append(name)
        return found

    def is_running(self, container: str) -> bool:
        self.calls.append(("is_running", container))
        return self.containers.get(container, ("", False))[1]

    def kill(self, container: str) -> None:
        self.calls.append(("kill", container))
        self.containers[container] = (self.containers[container][0], False)

    def fence(self, sandbox_id: str) -> list[str]:
        self.calls.append(("fence", sandbox_id))
        names = [name for name, (owner, _) in self.containers.items() if owner == sandbox_id]
        for name in names:
            del self.containers[name]
        return names

    def destroy(self, sandbox_id: str) -> None:
        self.calls.append(("destroy", sandbox_id))
        self.fence(sandbox_id)

    def health(self) -> BackendHealth:
        return BackendHealth(problems=["the recording engine is a test double: nothing runs here"],
                             summary="recording engine", storage="a dict")  # fmt: skip


@pytest.fixture
def recording(monkeypatch) -> None:
    """`recording` registered for this test only."""
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    backends.register(RecordingBackend.name, RecordingBackend)


def test_an_unknown_backend_is_refused_naming_the_known_ones_and_the_setting(tmp_path):
    with pytest.raises(ConfigError) as refused:
        load_config(state_dir=tmp_path, sandbox={"backend": "docker"})
    message = str(refused.value)
    assert "no sandbox backend is named 'docker'; known backends: podman" in message
    assert "sandbox.backend" in message and "BELAYER_SANDBOX__BACKEND" in message
    assert load_config(state_dir=tmp_path).sandbox.backend == "podman"


def test_a_name_is_registered_once(recording):
    with pytest.raises(ValueError, match="'podman' is already registered"):
        backends.register("podman", RecordingBackend)
    assert backends.checked_name("recording") == "recording"


def test_the_host_gets_the_configured_backend_and_drives_it(recording, tmp_path):
    config = load_config(state_dir=tmp_path / "state", sandbox={"backend": "recording"})
    host = make_host(config, store=LocalDirStore(tmp_path / "store"), host_queue="belayer-sandbox-here")
    backend = host.backend
    assert isinstance(backend, RecordingBackend)
    assert backend.opened_with == (config.sandbox, config.state_dir, config.cache_dir, ())

    # A worker restarted beside two lineages counts them, and one of them moved elsewhere.
    backend.start("sbx-stays", 1)
    moved = backend.start("sbx-moved", 1)
    host.adopt_existing()
    assert host.load().sandboxes == 2
    lineage.write(
        host.store, config.sandbox.checkpoint_prefix, "sbx-moved", 2, "belayer-sandbox-there", "sbx-moved-g2"
    )
    assert host.sweep_stale() == [moved]
    host.remove("sbx-stays")

    assert backend.containers == {} and host.load().sandboxes == 0
    assert [call for call in backend.calls if call[0] == "destroy"] == [
        ("destroy", "sbx-moved"),
        ("destroy", "sbx-stays"),
    ]


def test_the_stack_chaos_and_the_worker_get_the_configured_backend(recording, tmp_path):
    """Chaos finds and kills containers through the stack's `backend_on` / `containers_on`;
    `belayer status` and the sandbox worker's refusal read the backend's health."""
    config = load_config(state_dir=tmp_path / "state", sandbox={"backend": "recording"})
    backend = sandbox_hosts.backend_on(config, 0)
    assert isinstance(backend, RecordingBackend) and backend.opened_with[3] == ()

    row = sandbox_runtime_status(config)
    assert (row.healthy, row.address, row.detail) == (False, "a dict", backend.health().problems[0])
    assert check_host(config) == backend.health().problems


def test_chaos_finds_kills_and_counts_a_sandbox_through_the_backend(sandboxes):
    """`belayer chaos sandbox-crash` and the leak check on a real container, with no podman
    command of their own: the configured backend (podman) lists and kills it."""
    config = load_config(
        state_dir=runtime.default_state_dir(), sandbox={"channel_root": sandboxes.host.cfg.channel_root}
    )
    handle = sandboxes.create()
    container = handle.container
    chaos = Chaos(config)
    assert sandbox_hosts.host_of_container(config, 1, container) == 0
    assert sandbox_hosts.host_of_sandbox(config, 1, handle.sandbox_id) == 0  # of any generation
    assert sandbox_hosts.host_of_sandbox(config, 1, handle.sandbox_id[:-1]) is None  # not a prefix
    assert container in sandbox_containers(config) and not chaos.container_gone(container)

    report = chaos.inject("sandbox-crash", sandbox_container=container)
    assert (report.target, report.detail) == (
        f"container {container}",
        "podman kill (SIGKILL to every process in it)",
    )
    assert chaos.container_gone(container) and container in sandbox_containers(config)  # killed, left behind
    with pytest.raises(ChaosError, match=f"container {container} is not running: nothing to kill"):
        chaos.inject("sandbox-crash", sandbox_container=container)
