"""A directory that stands in for the object store (benchmarks on a host without S3).

Implements the slice of `belayer.storage.ObjectStore` that checkpoints use, with the
same contract: every object's sha256 is recorded at write time and checked on read
(`CorruptObject`), a missing key is `ObjectNotFound`. Not for production: no
replication, one host only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from belayer.storage.errors import CorruptObject, ObjectNotFound
from belayer.storage.store import ObjectRef


class LocalDirStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root.resolve() not in p.parents:
            raise ValueError(f"key {key!r} escapes {self.root}")
        return p

    def _write(self, key: str, chunks: Iterable[bytes]) -> ObjectRef:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        size = 0
        tmp = p.with_name(p.name + ".tmp")
        with open(tmp, "wb") as f:
            for chunk in chunks:
                h.update(chunk)
                size += len(chunk)
                f.write(chunk)
        os.replace(tmp, p)
        p.with_name(p.name + ".sha256").write_text(h.hexdigest())
        return ObjectRef(key=key, size=size, sha256=h.hexdigest())

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> ObjectRef:
        return self._write(key, [bytes(data)])

    def upload_stream(self, key: str, source, *, if_absent: bool = False, progress=None) -> ObjectRef:
        if hasattr(source, "read"):
            source = iter(lambda: source.read(1 << 20), b"")
        return self._write(key, source)

    def _recorded(self, key: str) -> str:
        try:
            return self._path(key).with_name(self._path(key).name + ".sha256").read_text().strip()
        except FileNotFoundError:
            raise ObjectNotFound(f"{key!r}: no such object in {self.root}") from None

    def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes:
        recorded = self._recorded(key)
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"{key!r}: no such object in {self.root}") from None
        got = hashlib.sha256(data).hexdigest()
        if got != recorded or (expected_sha256 and got != expected_sha256):
            raise CorruptObject(f"{key!r}: sha256 {got} does not match its record")
        return data

    def download_stream(self, key: str, dest: BinaryIO, *, expected_sha256: str | None = None, progress=None):
        recorded = self._recorded(key)
        h = hashlib.sha256()
        size = 0
        try:
            with open(self._path(key), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
                    size += len(chunk)
                    dest.write(chunk)
        except FileNotFoundError:
            raise ObjectNotFound(f"{key!r}: no such object in {self.root}") from None
        if h.hexdigest() != recorded or (expected_sha256 and h.hexdigest() != expected_sha256):
            raise CorruptObject(f"{key!r}: sha256 {h.hexdigest()} does not match its record")
        return ObjectRef(key=key, size=size, sha256=h.hexdigest())

    def delete(self, key: str) -> None:
        for p in (self._path(key), self._path(key).with_name(self._path(key).name + ".sha256")):
            p.unlink(missing_ok=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys under `prefix`, in key order (as S3 lists them)."""
        keys = (
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*")
            if p.is_file() and not p.name.endswith((".sha256", ".tmp"))
        )
        yield from sorted(k for k in keys if k.startswith(prefix))

    def delete_prefix(self, prefix: str) -> int:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        count = (
            sum(1 for p in base.rglob("*") if p.is_file() and not p.name.endswith(".sha256"))
            if base.exists()
            else 0
        )
        if base.is_dir():
            shutil.rmtree(base, ignore_errors=True)
        return count

    def close(self) -> None:
        pass
