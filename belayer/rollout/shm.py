"""Layouts of the node's two POSIX shared-memory segments, and the arena lease.

- weights: `[header page | manifest JSON | tensor bytes]`. The header carries a magic, the
  total size, a weights version and a status word the owner sets after each checksum pass;
  the manifest lists every tensor (vLLM parameter name, dtype, shape, offset, sha256).
  One segment per weights version: a publish stages the next version in a new segment,
  the owner checksums it and only then marks it OK, so no engine can map torn weights.
- KV arena: `[header page | raw KV bytes]`. The header carries magic, data size and the
  lease epoch. It names no weights version: which version is current is the node's decision
  (the node outlives every owner and tells a replacement), and a sealed version becomes
  current only when the node switches the engines to it. The lease is `flock` on the arena file (released by the kernel when the holder dies)
  plus the epoch, which the new holder bumps so a stale holder can tell.

Nothing here imports vLLM; engines and owner both use these helpers.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from belayer.rollout.errors import SharedMemoryError

SHM_DIR = Path("/dev/shm")
PAGE = 4096
WEIGHTS_MAGIC = b"BLYRWT01"
ARENA_MAGIC = b"BLYRKV01"
# weights header: magic, total size, manifest length, data offset, version, status
_WEIGHTS_HDR = struct.Struct("<8sQQQQQ")
# arena header: magic, data size, epoch
_ARENA_HDR = struct.Struct("<8sQQ")
STATUS_LOADING, STATUS_OK, STATUS_CORRUPT = 0, 1, 2
_STATUS_OFFSET = 8 + 8 * 4
_EPOCH_OFFSET = 8 + 8


def segment_prefix(node_id: str) -> str:
    return f"belayer-{node_id}-"


def weights_path(node_id: str, generation: int, version: int) -> Path:
    return SHM_DIR / f"{segment_prefix(node_id)}weights-g{generation}-v{version}"


def arena_path(node_id: str, generation: int) -> Path:
    return SHM_DIR / f"{segment_prefix(node_id)}kv-g{generation}"


def leftover_segments(node_id: str | None = None) -> list[Path]:
    """Segments of one node (or of every Belayer node) still present in /dev/shm. One
    node's are matched by their kind, so node `a`'s never include node `a-b`'s."""
    if node_id is None:
        return sorted(SHM_DIR.glob("belayer-*"))
    prefix = segment_prefix(node_id)
    return sorted(p for kind in ("weights-", "kv-") for p in SHM_DIR.glob(prefix + kind + "*"))


def unlink_segments(node_id: str) -> list[Path]:
    removed = []
    for path in leftover_segments(node_id):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def orphan_segments(prefix: str = "belayer-", min_age_s: float = 60.0) -> list[Path]:
    """Segments of nodes that are gone: a node whose supervisor was SIGKILLed (its children
    die with it, its segments do not). A node counts as gone only when no live process maps
    any of its segments and none was touched for `min_age_s`; a node whose owner died but
    whose engines still run keeps everything (its next recovery cleans up)."""

    by_node: dict[str, list[Path]] = {}
    for path in SHM_DIR.glob(prefix + "*"):
        node_part = path.name.split("-weights-")[0].split("-kv-")[0]  # belayer-<node>-weights-g1-v1
        by_node.setdefault(node_part + "-", []).append(path)
    now = time.time()
    candidates = {
        node: paths
        for node, paths in by_node.items()
        if all(now - p.stat().st_mtime >= min_age_s for p in paths)
    }
    if not candidates:
        return []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours to read
            continue
        for node in [n for n in candidates if str(SHM_DIR / n) in text]:
            del candidates[node]
    return sorted(p for paths in candidates.values() for p in paths)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sha256: str


# ---------------------------------------------------------------- weights segment


def create_weights_segment(path: Path, entries: list[TensorEntry], version: int) -> mmap.mmap:
    """Create the segment sized for `entries` (offsets relative to the data start); RW map."""
    manifest = json.dumps([e.__dict__ for e in entries]).encode()
    data_offset = _round_up(PAGE + len(manifest), PAGE)
    data_size = max((e.offset + e.nbytes for e in entries), default=0)
    total = data_offset + _round_up(data_size, PAGE)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mm[PAGE : PAGE + len(manifest)] = manifest
    mm[0 : _WEIGHTS_HDR.size] = _WEIGHTS_HDR.pack(
        WEIGHTS_MAGIC, total, len(manifest), data_offset, version, STATUS_LOADING
    )
    return mm


@dataclass
class WeightsHeader:
    total: int
    manifest_len: int
    data_offset: int
    version: int
    status: int


def read_weights_header(mm) -> WeightsHeader:
    magic, total, mlen, data_offset, version, status = _WEIGHTS_HDR.unpack_from(mm, 0)
    if magic != WEIGHTS_MAGIC:
        raise SharedMemoryError(f"weights segment has bad magic {magic!r}")
    if total != len(mm):
        raise SharedMemoryError(f"weights segment size {len(mm)} differs from its header ({total})")
    return WeightsHeader(total, mlen, data_offset, version, status)


def set_weights_status(mm, status: int) -> None:
    struct.pack_into("<Q", mm, _STATUS_OFFSET, status)


def read_manifest(mm) -> tuple[WeightsHeader, list[TensorEntry]]:
    header = read_weights_header(mm)
    raw = json.loads(bytes(mm[PAGE : PAGE + header.manifest_len]))
    return header, [TensorEntry(**{**e, "shape": tuple(e["shape"])}) for e in raw]


def map_readwrite(path: Path) -> mmap.mmap:
    """Map a staged segment for writing (the publisher fills it before the owner seals it)."""
    return _map(path, os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE)


def map_readonly(path: Path) -> mmap.mmap:
    """Map a segment read-only: a stray write from this process faults instead of corrupting it."""
    return _map(path, os.O_RDONLY, mmap.PROT_READ)


def _map(path: Path, flags: int, prot: int) -> mmap.mmap:
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise SharedMemoryError(f"shared-memory segment {path} is missing (memory owner gone?)") from None
    try:
        return mmap.mmap(fd, 0, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- KV arena


def create_arena(path: Path, data_size: int) -> None:
    """Create the arena: header page plus `data_size` raw bytes (sparse until touched)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, PAGE + data_size)
        os.pwrite(fd, _ARENA_HDR.pack(ARENA_MAGIC, data_size, 0), 0)
    finally:
        os.close(fd)


@dataclass
class ArenaHeader:
    data_size: int
    epoch: int


def read_arena_header(path: Path) -> ArenaHeader:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SharedMemoryError(f"KV arena {path} is missing (memory owner gone?)") from None
    try:
        raw = os.pread(fd, _ARENA_HDR.size, 0)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    magic, data_size, epoch = _ARENA_HDR.unpack(raw)
    if magic != ARENA_MAGIC:
        raise SharedMemoryError(f"KV arena {path} has bad magic {magic!r}")
    if size != PAGE + data_size:
        raise SharedMemoryError(f"KV arena {path} is {size} bytes, header says {PAGE + data_size}")
    return ArenaHeader(data_size, epoch)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class ArenaMapping:
    """One engine's view of the arena: mapped read-only until it holds the lease.

    The whole file is mapped once at a fixed address, so the KV tensors vLLM builds on it
    stay valid; taking the lease only flips the page protection to read-write.
    """

    def __init__(self, path: Path):
        self.path = path
        self.header = read_arena_header(path)
        self.fd = os.open(path, os.O_RDWR)  # RW fd: mprotect to PROT_WRITE needs it
        self.size = PAGE + self.header.data_size
        self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.address: int | None = None  # known once tensors are bound (data_tensor)
        self.writable = False
        self.epoch = 0

    def data_tensor(self, nbytes: int):
        """An int8 tensor over the first `nbytes` of the data region (after the header page)."""

        import torch  # import cost: torch, ~2.5 s; the CLI and the node import this module

        if nbytes > self.header.data_size:
            raise SharedMemoryError(
                f"vLLM wants {nbytes} KV bytes but the arena holds {self.header.data_size}; "
                "raise rollout.kv_cache_mb consistently for owner and engines"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the buffer is read-only until the lease: intended
            t = torch.frombuffer(self.mm, dtype=torch.int8, count=nbytes, offset=PAGE)
        self.address = t.data_ptr() - PAGE
        return t

    def try_take_lease(self) -> int:
        """Take the kernel lock (non-blocking), bump the epoch, make the mapping writable."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SharedMemoryError(
                    f"arena lease on {self.path} is still held by another engine"
                ) from None
            raise
        epoch = read_arena_header(self.path).epoch + 1
        os.pwrite(self.fd, struct.pack("<Q", epoch), _EPOCH_OFFSET)
        self._protect(mmap.PROT_READ | mmap.PROT_WRITE)
        self.writable, self.epoch = True, epoch
        return epoch

    def still_leader(self) -> bool:
        """Fencing check before each step: nobody has taken a newer epoch."""
        return self.writable and struct.unpack_from("<Q", self.mm, _EPOCH_OFFSET)[0] == self.epoch

    def _protect(self, prot: int) -> None:
        if self.address is None:
            raise SharedMemoryError(
                "the KV arena is not bound to vLLM's cache yet; cannot change its protection"
            )
        if _libc.mprotect(ctypes.c_void_p(self.address), ctypes.c_size_t(self.size), prot) != 0:
            err = ctypes.get_errno()
            raise SharedMemoryError(f"mprotect on the KV arena failed: {os.strerror(err)}")


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
