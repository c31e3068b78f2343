"""The container backend interface: what Belayer needs from a container engine.

`belayer.sandbox.podman.PodmanBackend` implements it over podman + runc + CRIU;
`belayer/sandbox/backends.py` registers the backends by name and opens the one
`sandbox.backend` names, for the sandbox host and for everything else that touches
containers (the stack's status, chaos, benchmarks), which use this interface and
nothing of the engine's own. A Docker-engine backend can implement the same protocol;
what it can and cannot do is listed in belayer/sandbox/README.md (`docker checkpoint`
has no file system and no --export, so `checkpoint_stream` would carry CRIU images only
and `restore` would need the rootfs diff shipped separately).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # config.py validates `sandbox.backend` against the registry, which imports this
    from belayer.sandbox.config import SandboxConfig
    from belayer.sandbox.images import ImageBuilder
    from belayer.sandbox.models import ImageSemantics


@dataclass(frozen=True)
class ContainerExit:
    """A lost container as its engine recorded it (`SandboxBackend.exit_state`)."""

    found: bool  # False: no such container here any more (removed: a fence, a drain, a destroy)
    running: bool = False  # still running: its supervisor merely does not answer
    exit_code: int | None = None  # PID 1's: 128 + N when a signal N ended it
    oom_killed: bool = False  # the engine saw an OOM kill in its cgroup (not recorded on every host)
    stopped_from_outside: tuple[str, ...] = ()  # the engine's kill / stop events for it


@dataclass(frozen=True)
class ContainerFacts:
    """One sandbox container as its engine reports it (`SandboxBackend.container_facts`)."""

    name: str
    sandbox_id: str
    running: bool
    created: float  # seconds since the epoch
    memory_bytes: int | None  # its memory cgroup's usage, tmpfs files included; None when not running
    disk_bytes: int | None  # its writable layer on the host's disk; None when the engine did not say


@dataclass(frozen=True)
class BackendHealth:
    """What `SandboxBackend.health` found on this host."""

    problems: list[str]  # each names its fix; empty: sandboxes run, checkpoint and restore here
    summary: str  # what runs them (versions, the base image), for `belayer status`
    storage: str  # where the containers' state lives on this host, for `belayer status`

    @property
    def ok(self) -> bool:
        return not self.problems


class SandboxBackend(Protocol):
    """Lifecycle of one sandbox lineage's containers on this host."""

    name: str

    def create(
        self, sandbox_id: str, generation: int, labels: dict[str, str], image: str | None = None,
        semantics: ImageSemantics | None = None,
    ) -> str:  # fmt: skip
        """Start a container of `image` (default: the configured base image) running the
        supervisor as PID 1, run as `semantics` says when it is a task's own; return its name."""

    def container_name(self, sandbox_id: str, generation: int) -> str:
        """The name the container of that generation of the lineage has (or would have)."""

    def channel_path(self, sandbox_id: str) -> Path:
        """Host path of the supervisor's unix socket for this lineage."""

    def is_running(self, container: str) -> bool:
        """The container exists and runs."""

    def kill(self, container: str) -> None:
        """SIGKILL the container and leave it behind (a crash, for tests and chaos)."""

    def exit_state(self, container: str) -> ContainerExit:
        """How a container whose supervisor stopped answering ended, once the engine has
        seen it end, and whether anyone on this host stopped it (the host names the cause
        of a lost sandbox from it)."""

    def memory_cgroup(self, container: str) -> Path | None:
        """The file where the kernel counts OOM kills in the running container's memory
        cgroup (`oom_kills` reads it); None when it cannot be found."""

    def image_builder(self) -> ImageBuilder:
        """What builds task images from their Dockerfiles into this host's image storage."""

    def container_facts(self) -> list[ContainerFacts]:
        """Every Belayer container on this host with its state, age, memory and disk (`belayer sandboxes`)."""

    def disk_used(self, container: str) -> int | None:
        """Bytes the container's writable layer holds (what the agent wrote over its image);
        None when the engine cannot say."""

    def lineages(self) -> dict[str, list[str]]:
        """Every Belayer container on this host (any state), by sandbox id (the stale-lineage
        sweep, chaos, leak checks)."""

    def fence(self, sandbox_id: str) -> list[str]:
        """Remove every container of the lineage on this host (before a restore); their names."""

    def destroy(self, sandbox_id: str) -> None:
        """Remove the lineage's containers, network namespace and channel directory."""

    def checkpoint_stream(self, container: str, phases: dict[str, float] | None = None
                          ) -> AbstractContextManager[Iterator[bytes]]:  # fmt: skip
        """Dump the running container (it keeps running) as an archive byte stream; once
        it has ended, `phases` holds what the backend measured of it (seconds by phase)."""

    def export_checkpoint(self, container: str, dest: Path, phases: dict[str, float] | None = None) -> None:
        """Dump the running container (it keeps running) as an uncompressed archive file at
        `dest`; `phases` as for `checkpoint_stream`."""

    def restore(self, archive: Path, sandbox_id: str, generation: int) -> str:
        """Start a container from an archive file; return its name."""

    def fork(self, plain_archive: Path, parent_id: str, sandbox_id: str, generation: int) -> str:
        """Start another lineage's checkpoint (an uncompressed archive) as `sandbox_id`; its name."""

    def exec_as_root(self, container: str, argv: list[str], stdin: bytes | None = None) -> bytes:
        """Run a short Belayer helper (hash, tar) in the container as its root, out of the
        agent's reach (another uid; never checkpointed); its stdout."""

    def image_id(self, image: str | None = None) -> str:
        """Id of `image` (default: the base image) on this host; "" when it has none (a
        restore needs the same id)."""

    def established_tcp_sockets(self, plain_archive: Path) -> int:
        """Established TCP sockets a plain checkpoint archive holds: a fork starts with them
        closed (two forks cannot own one connection), a restore of the same lineage keeps them."""

    def container_image(self, container: str) -> str | None:
        """The image a container was started from, as it was named; None when it is gone."""

    def save_image(self, image: str, dest: Path) -> None:
        """Write `image` (with its name) to the archive file `dest`."""

    def load_image(self, src: Path) -> None:
        """Load an archive `save_image` wrote, name included."""

    def versions(self) -> dict[str, str]:
        """Versions that a checkpoint depends on (engine, CRIU)."""

    def health(self) -> BackendHealth:
        """Whether this host can run, checkpoint and restore sandboxes: the sandbox worker
        refuses to serve with problems, `belayer status` shows the result."""

    def baseline_checkpoint(self, container: str, archive: Path) -> dict[str, float]:
        """Checkpoint the running container (it keeps running) into a compressed `archive`
        file the way a user of the engine would without Belayer, with the engine's own
        tools and defaults: the baseline `belayer bench checkpoint` measures Belayer
        against. Returns the engine's own phases (seconds by phase)."""

    def baseline_restore(self, container: str, archive: Path) -> None:
        """Remove the (killed) `container` and start it again from a `baseline_checkpoint`
        archive, the way a user of the engine would without Belayer."""


class BackendFactory(Protocol):
    """How the registry makes a backend: a backend class's constructor has this signature.

    `command_prefix` is a command every engine call runs through first: `nsenter` into a
    sandbox host's namespaces where several hosts share one machine
    (belayer/stack/sandbox_hosts.py)."""

    def __call__(self, cfg: SandboxConfig, state_dir: Path, cache_dir: Path | None = None, *,
                 command_prefix: Sequence[str] = ()) -> SandboxBackend: ...  # fmt: skip


def oom_kills(counter: Path | None) -> int | None:
    """The `oom_kill` count of a memory cgroup's `memory.oom_control` / `memory.events`
    (`SandboxBackend.memory_cgroup`); None when it cannot be read (the cgroup is gone, or
    was never found)."""
    if counter is None:
        return None
    try:
        text = counter.read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), None)
