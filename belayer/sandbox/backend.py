"""The container backend interface: what the sandbox host needs from a container engine.

`belayer.sandbox.podman.PodmanBackend` implements it over podman + runc + CRIU. A
Docker-engine backend can implement the same protocol; what it can and cannot do is
listed in belayer/sandbox/README.md (`docker checkpoint` has no file system and no
--export, so `checkpoint_stream` would carry CRIU images only and `restore` would
need the rootfs diff shipped separately).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol


class SandboxBackend(Protocol):
    """Lifecycle of one sandbox lineage's containers on this host."""

    name: str

    def create(self, sandbox_id: str, generation: int, labels: dict[str, str]) -> str:
        """Start a container running the supervisor as PID 1; return its name."""

    def container_name(self, sandbox_id: str, generation: int) -> str:
        """The name the container of that generation of the lineage has (or would have)."""

    def channel_path(self, sandbox_id: str) -> Path:
        """Host path of the supervisor's unix socket for this lineage."""

    def is_running(self, container: str) -> bool:
        """The container exists and runs."""

    def kill(self, container: str) -> None:
        """SIGKILL the container and leave it behind (a crash, for tests and chaos)."""

    def lineages(self) -> dict[str, list[str]]:
        """Every Belayer container on this host, by sandbox id (the stale-lineage sweep)."""

    def fence(self, sandbox_id: str) -> list[str]:
        """Remove every container of the lineage on this host (before a restore)."""

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

    def image_id(self) -> str:
        """Id of the base image on this host (a restore needs the same one)."""

    def versions(self) -> dict[str, str]:
        """Versions that a checkpoint depends on (engine, CRIU)."""
