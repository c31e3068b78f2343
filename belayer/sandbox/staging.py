"""A sandbox host's disk between its sandboxes and the store, under one budget.

Three kinds of files wait there: checkpoints captured and not yet uploaded (a checkpoint
is taken in two halves: SandboxHost.capture_checkpoint says why), the archives a restore
or a fork downloaded and unpacked, and a cache of the archives forks started from. Without a bound, a store that stays down while
trajectories keep checkpointing fills the host's disk, and with it every sandbox's.

Forks start from a group's set-up checkpoint, and a training run forks the same one again
every iteration (`reuse_setup`): each host keeps the unpacked archive it forked from,
named by the archive's sha256, so the next fork of it there skips the download and the
decompression. Only forks fill the cache (a rare path); checkpoints, the frequent one,
pay nothing for it (a cache teed at every checkpoint cost each 0.09 s here and was
removed). A fork takes a hard link of the cached file, so an eviction never pulls an
archive from under a restore.

So each capture first checks the budget (`sandbox.staging_budget_mb`). Over it, the host
evicts the cached fork archives (they can be downloaded again), then, oldest first, the
staged checkpoints no trajectory can still publish: those of a
sandbox no longer on this host, and those a newer capture of the same sandbox superseded
(a trajectory captures again only once its previous checkpoint was settled, stored or
given up). Archives being restored from are in use and never evicted. If that is not
enough, the capture is refused (`StagingFull`): the trajectory goes on unprotected until
its next checkpoint, the cost a failed checkpoint always had, instead of a full disk.

Each host has its own directories, named by its queue, so hosts sharing a machine (the
local stack's) keep separate accounts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from belayer.sandbox.errors import StagingFull
from belayer.sandbox.models import path_under

log = logging.getLogger(__name__)

STAGED_DIR = "staged-checkpoints"  # under the state directory: captured, not yet published
IMPORTS_DIR = "imports"  # archives downloaded for a restore or a fork, while it runs
CACHE_DIR = "fork-archives"  # unpacked archives forks started from, by the archive's sha256
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A staged file's name: its sandbox id, then its checkpoint's directory (head step,
# generation, random suffix), as SandboxHost._checkpoint_base makes them.
_STAGED_NAME = re.compile(r"^(?P<sandbox>sbx-[0-9a-z-]+)--(?P<head>\d{8})-g\d+-[0-9a-f]+\.tar$")


@dataclass(frozen=True)
class StagingUsage:
    """What `belayer sandboxes` shows of a host's staging disk."""

    staged_bytes: int
    importing_bytes: int
    cached_bytes: int
    budget_bytes: int
    evicted: int  # staged files and cached archives evicted to make room since the host started

    @property
    def used_bytes(self) -> int:
        return self.staged_bytes + self.importing_bytes + self.cached_bytes


class Staging:
    """The staging directories of the host whose queue `host_queue()` names (read at each
    use: a host may be given its queue after it was made)."""

    def __init__(self, state_dir: Path, host_queue: Callable[[], str], budget_bytes: int) -> None:
        self.state_dir, self.host_queue, self.budget_bytes = Path(state_dir), host_queue, budget_bytes
        self.evicted = 0
        self.cache_hits = 0

    @property
    def staged_dir(self) -> Path:
        return self.state_dir / STAGED_DIR / self.host_queue()

    @property
    def imports_dir(self) -> Path:
        return self.state_dir / "tmp" / IMPORTS_DIR / self.host_queue()

    @property
    def cache_dir(self) -> Path:
        return self.state_dir / "tmp" / CACHE_DIR / self.host_queue()

    def staged_path(self, name: str) -> Path:
        self.staged_dir.mkdir(parents=True, exist_ok=True)
        return path_under(self.staged_dir, name)

    def staged_of(self, sandbox_id: str) -> list[Path]:
        return [p for p in self._staged() if _sandbox_of(p) == sandbox_id]

    @contextlib.contextmanager
    def importing(self, sandbox_id: str) -> Iterator[Path]:
        """A private directory for an archive being restored from, removed afterwards."""
        self.imports_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.imports_dir, prefix=f"restore-{sandbox_id}-") as d:
            yield Path(d)

    @contextlib.contextmanager
    def fork_archive(
        self, sandbox_id: str, archive_sha256: str, fetch: Callable[[Path], object]
    ) -> Iterator[Path]:
        """The unpacked archive of the checkpoint whose stored archive has `archive_sha256`,
        in a private directory removed afterwards: a hard link of the cached copy, or
        `fetch(dest)` (download, check, unpack) and then the cache keeps it."""
        if not _SHA256.match(archive_sha256):
            raise ValueError(f"archive sha256 {archive_sha256!r} is not 64 hex digits")
        cached = self.cache_dir / f"{archive_sha256}.tar"
        with self.importing(sandbox_id) as private:
            plain = private / "plain.tar"
            try:
                os.link(cached, plain)
                os.utime(cached)  # recently used: evicted last
                self.cache_hits += 1
            except FileNotFoundError:
                fetch(plain)
                self._keep(plain, cached)
            yield plain

    def forget_fork_archive(self, archive_sha256: str) -> None:
        """Drop a cached archive forks could not start from (damaged on this disk)."""
        if _SHA256.match(archive_sha256):
            (self.cache_dir / f"{archive_sha256}.tar").unlink(missing_ok=True)

    def drop_imports(self) -> int:
        """Remove what an earlier worker of this host left being imported (it died mid-restore
        or mid-fork: no restore of this process uses it); how many files went."""
        if not self.imports_dir.is_dir():
            return 0
        files = [p for p in self.imports_dir.rglob("*") if p.is_file()]
        shutil.rmtree(self.imports_dir, ignore_errors=True)
        return len(files)

    def drop_cache(self) -> None:
        """Remove every cached fork archive (the host stops; nothing else uses them)."""
        for entry in self._cached():
            entry.unlink(missing_ok=True)
        for partial in self.cache_dir.glob("*.partial") if self.cache_dir.is_dir() else ():
            partial.unlink(missing_ok=True)  # of a fork that died between link and rename
        with contextlib.suppress(OSError):
            self.cache_dir.rmdir()

    def _keep(self, plain: Path, cached: Path) -> None:
        """Best effort: a copy that cannot be kept is logged, never fails the fork (two forks
        of one archive at once each keep theirs under a name of its own, the last wins)."""
        partial = cached.with_name(f"{cached.stem}.{uuid.uuid4().hex}.partial")
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            os.link(plain, partial)
            os.replace(partial, cached)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            log.warning("fork archive %s not cached: %s", cached.name, exc)
            return
        self._trim_cache()

    def _trim_cache(self) -> None:
        """The cache alone never takes the host over its budget: oldest entries go first."""
        used = self.usage().used_bytes
        for entry in sorted(self._cached(), key=_mtime):
            if used < self.budget_bytes:
                return
            used -= _size(entry)
            entry.unlink(missing_ok=True)
            self.evicted += 1

    def usage(self) -> StagingUsage:
        """Bytes by kind; a file linked in two places (a cached archive a fork is using) counts once."""
        seen: set[tuple[int, int]] = set()
        return StagingUsage(
            staged_bytes=_bytes(self._staged(), seen),
            cached_bytes=_bytes(self._cached(), seen),
            importing_bytes=_bytes(
                (p for p in self.imports_dir.rglob("*") if p.is_file()) if self.imports_dir.is_dir() else (),
                seen,
            ),
            budget_bytes=self.budget_bytes,
            evicted=self.evicted,
        )

    def make_room(self, live_sandboxes: Callable[[], set[str]]) -> None:
        """Before a capture: under the budget, or brought under it by evicting cached fork
        archives and what no trajectory can still publish, oldest first; `StagingFull`
        when neither."""
        used = self.usage().used_bytes
        if used < self.budget_bytes:
            return
        for path in [*sorted(self._cached(), key=_mtime), *self._evictable(live_sandboxes())]:
            used -= _size(path)
            path.unlink(missing_ok=True)
            self.evicted += 1
            log.info("staging over budget: evicted %s, which nothing still needs", path.name)
            if used < self.budget_bytes:
                return
        raise StagingFull(
            f"sandbox host {self.host_queue()}: its staging disk holds {used / 2**20:.0f} MiB "
            f"(checkpoints waiting for upload, archives being restored) of its "
            f"{self.budget_bytes / 2**20:.0f} MiB budget (sandbox.staging_budget_mb), and every staged "
            "checkpoint may still be published: this checkpoint is skipped and the step goes "
            "unprotected until the next. Raise the budget, or find why uploads are not keeping up "
            "(is the object store reachable?)"
        )

    def _evictable(self, live: set[str]) -> list[Path]:
        """Oldest first: staged files of sandboxes not on this host, and each sandbox's
        staged files but its newest."""
        staged = sorted(self._staged(), key=_mtime)
        newest: dict[str, Path] = {}
        for path in sorted(staged, key=_head):
            newest[_sandbox_of(path)] = path  # the last one wins: the newest capture
        return [p for p in staged if _sandbox_of(p) not in live or newest[_sandbox_of(p)] != p]

    def _staged(self) -> list[Path]:
        if not self.staged_dir.is_dir():
            return []
        return [p for p in self.staged_dir.iterdir() if _STAGED_NAME.match(p.name)]

    def _cached(self) -> list[Path]:
        if not self.cache_dir.is_dir():
            return []
        return [p for p in self.cache_dir.iterdir() if p.suffix == ".tar" and _SHA256.match(p.stem)]


def _bytes(paths, seen: set[tuple[int, int]]) -> int:
    total = 0
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def _sandbox_of(path: Path) -> str:
    return _STAGED_NAME.match(path.name)["sandbox"]


def _head(path: Path) -> int:
    return int(_STAGED_NAME.match(path.name)["head"])


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
