"""Host-local plain copies of the checkpoints this host wrote: a restore or fork here
skips the download and the decompression.

Why: most restores run on the host that took the checkpoint -- the sandbox's container
died, a context cut rolls it back, a group forks its set-up sandbox, a branch starts from
a parent on the same host. Fetching the archive back (download, sha256, `zstd -d`) was a
third of a restore here (`belayer bench checkpoint`, phase `fetch`). The checkpoint's
plain stream is teed to a file as podman writes it, so keeping it costs no second pass.

The object store stays the truth. A host restoring a checkpoint it does not hold (the
host was lost, the copy was evicted) downloads it as before, and a copy podman cannot
import is dropped and the archive downloaded (`SandboxHost._unpacked`).

Trust: only this host's worker writes here, in its state directory, which no sandbox can
reach. A copy enters by an atomic rename once its checkpoint's archive and metadata are
stored, so a crash mid-dump leaves only a staging file, removed at the next start.

Bounds: one copy per sandbox (its newest checkpoint: the one a recovery tries first)
and `sandbox.archive_cache_mb` in all, the least recently used evicted first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

STAGING_PREFIX = "staging-"


class ArchiveCache:
    """Plain archives by their stored archive's sha256, one per sandbox, `max_bytes` in all."""

    def __init__(self, root: Path, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._guard = threading.Lock()
        if self.enabled:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{STAGING_PREFIX}*"):
                stale.unlink(missing_ok=True)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @contextlib.contextmanager
    def staged(self) -> Iterator[Path | None]:
        """A fresh path to tee a checkpoint's plain stream into (None when caching is off),
        removed on the way out unless `admit` took it."""
        if not self.enabled:
            yield None
            return
        path = self.root / f"{STAGING_PREFIX}{secrets.token_hex(6)}.tar"
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)

    def admit(self, staged: Path, sandbox_id: str, archive_sha256: str) -> None:
        """Keep `staged` as the copy of the archive `archive_sha256`, the newest of
        `sandbox_id`: the sandbox's older copy goes, then the least recently used over budget."""
        entry = self._entry(sandbox_id, archive_sha256)
        with self._guard:
            for older in self.root.glob(f"{sandbox_id}.*.tar"):
                older.unlink(missing_ok=True)
            if staged.stat().st_size > self.max_bytes:
                return  # alone over budget: evicting the others would not make room
            os.replace(staged, entry)
            self._evict_over_budget(keep=entry)

    def take(self, archive_sha256: str, into: Path) -> Path | None:
        """A hard link at `into` to the copy of `archive_sha256` (an eviction meanwhile leaves
        it whole), marked recently used; None when this host holds no copy."""
        with self._guard:
            found = next(self.root.glob(f"*.{archive_sha256}.tar"), None) if self.enabled else None
            if found is None:
                return None
            try:
                os.link(found, into)
                os.utime(found)
            except OSError:  # gone meanwhile, or another file system: download instead
                return None
        return into

    def drop(self, archive_sha256: str) -> None:
        """Forget the copy of `archive_sha256` (podman could not import it)."""
        with self._guard:
            for entry in self.root.glob(f"*.{archive_sha256}.tar"):
                log.warning("dropped the local copy %s of a checkpoint: podman could not import it", entry.name)
                entry.unlink(missing_ok=True)

    def forget(self, sandbox_id: str) -> None:
        """Remove the copies of a sandbox whose checkpoints are deleted."""
        with self._guard:
            for entry in self.root.glob(f"{sandbox_id}.*.tar"):
                entry.unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove every copy (a restore then downloads, as on another host)."""
        with self._guard:
            for entry in self.root.glob("*.tar"):
                if not entry.name.startswith(STAGING_PREFIX):
                    entry.unlink(missing_ok=True)

    def _entry(self, sandbox_id: str, archive_sha256: str) -> Path:
        return self.root / f"{sandbox_id}.{archive_sha256}.tar"

    def _evict_over_budget(self, *, keep: Path) -> None:
        entries = []
        for entry in self.root.glob("*.tar"):
            if entry.name.startswith(STAGING_PREFIX):
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            entries.append((stat.st_mtime, stat.st_size, entry))
        total = sum(size for _, size, _ in entries)
        for _, size, entry in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if entry != keep:
                entry.unlink(missing_ok=True)
                total -= size
