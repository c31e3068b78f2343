"""Record logs: small JSON records by position (a trajectory's steps), append-only in S3.

A trajectory's step log would grow the workflow's state by one record a turn; here it
lives in the object store and the workflow keeps a `RecordLogRef` (key and length).

Layout of a log at key `K` (relative to the store's key_prefix):
- `K/manifest.json` — format and, for a fork, the base log and how many of its records
  the fork inherits. Written once, create-if-absent.
- `K/<position>/record` — one JSON record, position 1-based and zero-padded to 8 digits
  so that listing order is position order. Written create-if-absent: a retried write of
  the same record is a no-op; a different record at a taken position raises
  `ObjectConflict` instead of rewriting history. The name `record` is among the names
  archive encryption covers (`belayer.storage.encryption`), so a store wrapped for
  encryption keeps the records encrypted at rest.

A log forks like a token log: `RecordLog.fork(store, base, upto, key)` starts a new
log whose first `upto` records are read through the base, so nothing is copied.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from belayer.storage.errors import CorruptObject, ObjectConflict, ObjectNotFound

FORMAT = "belayer-recordlog/1"
_READ_THREADS = 8


class RecordLogRef(BaseModel):
    """The first `length` records of the log at `key`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1, description="Key of the log (relative to the store's key_prefix).")
    length: int = Field(0, ge=0, description="Records 1..length belong to this log (own or inherited).")


class RecordLog:
    """Append and read the records of one log; any number of writers of the same records."""

    def __init__(self, store: Any, key: str):
        self.store = store
        self.key = key.rstrip("/")

    @classmethod
    def create(cls, store: Any, key: str) -> RecordLog:
        """A new, empty log at `key` (idempotent)."""
        _write_manifest(store, key, base=None)
        return cls(store, key)

    @classmethod
    def fork(cls, store: Any, base: RecordLogRef, key: str) -> RecordLog:
        """A new log at `key` whose records 1..base.length are `base`'s."""
        _write_manifest(store, key, base=base)
        return cls(store, key)

    def put(self, position: int, record: dict) -> None:
        """Write record `position` once; the same record again is a no-op."""
        if position < 1:
            raise ValueError(f"record positions start at 1, not {position}")
        body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        key = _record_key(self.key, position)
        try:
            self.store.put_bytes(key, body, if_absent=True)
        except ObjectConflict:
            # Encrypted bytes differ between two writes of one record: compare plaintexts.
            if self.store.get_bytes(key) != body:
                raise ObjectConflict(
                    f"record log {self.key!r}: position {position} holds another record"
                ) from None

    def read(self, upto: int) -> list[dict]:
        """Records 1..upto, in order; `CorruptObject` when one is missing."""
        return _collect(self.store, self.key, upto)

    def exists(self) -> bool:
        """Whether the log was created (its manifest written)."""
        return self.store.exists(_manifest_key(self.key))

    def get(self, position: int) -> dict:
        """Record `position`, one of the log's own (a fork's inherited ones are its base's)."""
        return json.loads(_get_record(self.store, self.key, position))

    def written(self) -> int:
        """How many records the log holds (1..N, its own: a fork's inherited ones are not
        counted), found by listing: what a reader without a `RecordLogRef` trusts, e.g. a
        resume after the writer died between writing a record and saying so."""
        _read_manifest(self.store, self.key)
        positions = [int(k[len(self.key) + 1 :].split("/", 1)[0]) for k in self.store.list(f"{self.key}/")
                     if k.endswith("/record")]  # fmt: skip
        if sorted(positions) != list(range(1, len(positions) + 1)):
            raise CorruptObject(
                f"record log {self.key!r}: records {sorted(positions)} are not 1..{len(positions)}"
            )
        return len(positions)


def _collect(store: Any, key: str, upto: int) -> list[dict]:
    if upto <= 0:
        return []
    manifest = _read_manifest(store, key)
    records: list[dict] = []
    own_from = 1
    if manifest["base"] is not None:
        base = RecordLogRef.model_validate(manifest["base"])
        inherited = min(upto, base.length)
        records = _collect(store, base.key, inherited)
        own_from = base.length + 1
    positions = list(range(own_from, upto + 1))
    with ThreadPoolExecutor(_READ_THREADS) as pool:
        bodies = list(pool.map(lambda p: _get_record(store, key, p), positions))
    return records + [json.loads(b) for b in bodies]


def _get_record(store: Any, key: str, position: int) -> bytes:
    try:
        return store.get_bytes(_record_key(key, position))
    except ObjectNotFound:
        raise CorruptObject(f"record log {key!r}: record {position} is missing") from None


def _record_key(key: str, position: int) -> str:
    return f"{key}/{position:08d}/record"


def _manifest_key(key: str) -> str:
    return f"{key}/manifest.json"


def _write_manifest(store: Any, key: str, *, base: RecordLogRef | None) -> None:
    manifest = {"format": FORMAT, "base": base.model_dump() if base else None}
    body = json.dumps(manifest, sort_keys=True).encode()
    try:
        store.put_bytes(_manifest_key(key.rstrip("/")), body, if_absent=True)
    except ObjectConflict:
        raise ObjectConflict(f"record log {key!r} exists already with another manifest") from None


def _read_manifest(store: Any, key: str) -> dict:
    try:
        manifest = json.loads(store.get_bytes(_manifest_key(key)))
    except ObjectNotFound:
        raise CorruptObject(f"no record log at {key!r} (its manifest is missing)") from None
    if manifest.get("format") != FORMAT:
        raise CorruptObject(f"record log {key!r}: unknown format {manifest.get('format')!r}")
    return manifest
