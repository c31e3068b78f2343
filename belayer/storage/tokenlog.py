"""Token logs: a trajectory's token ids, append-only in S3, read back as exact prefixes.

What crosses process boundaries (Temporal payloads) is a `PrefixRef` — log key,
prefix length, sha256 of that prefix — never the token array.

Canonical encoding: the sha256 of a prefix is taken over its token ids as a packed
array of little-endian unsigned 32-bit integers (`encode_tokens`), with no header and
no separator, so any process can recompute it from the ids alone.

Layout of a log at key `K` (relative to the store's key_prefix):
- `K/manifest.json` — format, encoding and, for a fork, the base `PrefixRef`. Written
  once, create-if-absent, never updated: appends never race on it, and it stays the
  same few hundred bytes however many turns the trajectory has.
- `K/seg/<start>.u32` — one segment per append (a turn), `start` = absolute position of
  its first token, zero-padded to 12 digits so that listing order is position order.
  Segments are written create-if-absent: a retried append of the same tokens is a
  no-op, and a different append at a position already taken raises `ObjectConflict`
  instead of rewriting history. Reading a prefix lists the segments (one LIST call per
  1000 turns) and fetches the ones it needs in parallel.

A context that must diverge from its log (prefix consistency after a restore, or a
retried turn that sampled different tokens) forks: `TokenLog.fork(store, ref, new_key)`
starts a new log whose first `ref.length` tokens are `ref`'s prefix, read through the
base log, so nothing is copied.

Source marks: every segment records whether the model generated its tokens ("model") or
the environment supplied them ("env": the prompt, observations), in the segment object's
own metadata (`x-amz-meta-source`), written by the same PUT as the tokens: a segment is
never visible without its mark, and a retried append that names another source conflicts
like different tokens would. `read_marks` turns a prefix into spans and `loss_mask` into
the trainer's per-token mask; a fork inside a segment keeps that segment's mark for the
tokens it keeps. Segments written before marks existed carry none and read as "env"
(nothing in them is trained on).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from belayer.storage.errors import CorruptObject, ObjectConflict, ObjectNotFound
from belayer.storage.store import ObjectStore

FORMAT = "belayer-tokenlog/1"
ENCODING = "u32le"
MAX_TOKEN_ID = 2**32 - 1
_SEGMENT = re.compile(r"^(\d{12})\.u32$")
_READ_THREADS = 8

Source = Literal["model", "env"]
SOURCES: tuple[Source, ...] = ("model", "env")
UNMARKED_SOURCE: Source = "env"
_SOURCE_METADATA = "source"


class Span(NamedTuple):
    """Tokens [start, end) of a prefix, all from one source."""

    start: int
    end: int
    source: Source


class PrefixRef(BaseModel):
    """The first `length` tokens of the token log at `key`, whose sha256 is `sha256`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1, description="Key of the token log (relative to the store's key_prefix).")
    length: int = Field(ge=0, description="Number of tokens in the prefix.")
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="sha256 of the prefix as little-endian uint32 token ids."
    )


def encode_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as packed little-endian uint32 (the canonical encoding)."""
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - no supported platform has this
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def decode_tokens(data: bytes) -> list[int]:
    """Inverse of `encode_tokens`."""
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes is not a whole number of uint32 token ids")
    packed = array("I")
    packed.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def prefix_sha256(tokens: Iterable[int]) -> str:
    """sha256 (hex) of `tokens` in the canonical encoding."""
    return hashlib.sha256(encode_tokens(tokens)).hexdigest()


def prefix_ref(key: str, tokens: list[int]) -> PrefixRef:
    """The `PrefixRef` of `tokens` as the first len(tokens) tokens of the log at `key`."""
    return PrefixRef(key=key, length=len(tokens), sha256=prefix_sha256(tokens))


class TokenLog:
    """One writer's handle on an append-only token log. Not thread-safe; one per trajectory branch."""

    def __init__(self, store: ObjectStore, key: str, *, prefix: bytes = b""):
        self.store = store
        self.key = key.rstrip("/")
        self._length = len(prefix) // 4
        self._hasher = hashlib.sha256(prefix)

    @classmethod
    def _at(cls, store: ObjectStore, key: str, length: int, hasher) -> TokenLog:
        log = cls(store, key)
        log._length, log._hasher = length, hasher
        return log

    @classmethod
    def create(cls, store: ObjectStore, key: str) -> TokenLog:
        """A new, empty log at `key` (idempotent: an existing log of the same kind is reopened empty,
        and replayed appends of the same tokens then succeed)."""
        _write_manifest(store, key, base=None)
        return cls(store, key)

    @classmethod
    def fork(cls, store: ObjectStore, ref: PrefixRef, key: str) -> TokenLog:
        """A new log at `key` that starts as the verified prefix `ref` of another log."""
        prefix = _read_verified(store, ref)
        _write_manifest(store, key, base=ref)
        return cls(store, key, prefix=prefix)

    @classmethod
    def resume(cls, store: ObjectStore, ref: PrefixRef) -> TokenLog:
        """Continue appending to `ref.key` after `ref` (the prefix is read and verified).

        When this process has seen a shorter prefix of the same log (it appended or read
        it), only the segments after it are read, hashed on from the remembered state and
        checked against `ref.sha256`: segments are write-once, so a trajectory's turns
        cost O(1) reads instead of O(turns) even when two processes (the engine and the
        context worker) take turns appending.
        """
        key = ref.key.rstrip("/")
        seen = _HEADS.latest(store, key)
        if seen is not None and seen[0] <= ref.length:
            length, hasher = seen
            tail = _read_forward(store, key, length, ref.length)
            if tail is not None:
                hasher.update(tail)
                if hasher.hexdigest() == ref.sha256:
                    log = cls._at(store, key, ref.length, hasher)
                    _HEADS.remember(store, key, ref.length, hasher)
                    return log
        log = cls(store, key, prefix=_read_verified(store, ref))
        _HEADS.remember(store, key, ref.length, log._hasher)
        return log

    @property
    def head(self) -> PrefixRef:
        """The ref of everything appended so far."""
        return PrefixRef(key=self.key, length=self._length, sha256=self._hasher.hexdigest())

    def head_after(self, tokens: Iterable[int]) -> PrefixRef:
        """The ref this log will have once `tokens` are appended (nothing is written)."""
        data = encode_tokens(tokens)
        hasher = self._hasher.copy()
        hasher.update(data)
        return PrefixRef(key=self.key, length=self._length + len(data) // 4, sha256=hasher.hexdigest())

    def append(self, tokens: Iterable[int], *, source: Source) -> PrefixRef:
        """Append one segment (e.g. a turn's tokens) that came from `source` ("model" for
        sampled tokens, "env" for the prompt and observations); returns the ref of the
        whole log so far.

        Retrying the same append is harmless; a different append (other tokens or another
        source) where one already exists raises `ObjectConflict` (fork from the last good
        ref instead).
        """
        if source not in SOURCES:
            raise ValueError(f"token source must be one of {SOURCES}, not {source!r}")
        data = encode_tokens(tokens)
        if not data:
            return self.head
        segment_key = _segment_key(self.key, self._length)
        try:
            self.store.put_bytes(segment_key, data, if_absent=True, metadata={_SOURCE_METADATA: source})
        except ObjectConflict as exc:
            raise ObjectConflict(
                f"token log {self.key!r} already holds different tokens (or another source) at position "
                f"{self._length} (another writer appended, or this context diverged); fork the log from "
                f"your last PrefixRef with TokenLog.fork: {exc}"
            ) from None
        self._hasher.update(data)
        self._length += len(data) // 4
        _HEADS.remember(self.store, self.key, self._length, self._hasher)
        return self.head

    def read_prefix(self, ref: PrefixRef) -> list[int]:
        return read_prefix(self.store, ref)


class _Recent:
    """Per log (in one bucket and key prefix): the longest prefix this process has seen,
    as (length, value); the least recently used logs are forgotten."""

    def __init__(self, kept: int):
        self.kept = kept
        self.lock = threading.Lock()
        self.states: OrderedDict[tuple, tuple[int, Any]] = OrderedDict()

    @staticmethod
    def _where(store: ObjectStore, key: str) -> tuple:
        cfg = getattr(store, "cfg", None)
        place = (cfg.endpoint, cfg.bucket, cfg.key_prefix) if cfg is not None else id(store)
        return (place, key)

    def remember(self, store: ObjectStore, key: str, length: int, value) -> None:
        where = self._where(store, key)
        with self.lock:
            known = self.states.get(where)
            if known is None or known[0] <= length:
                self.states[where] = (length, value)
            self.states.move_to_end(where)
            while len(self.states) > self.kept:
                self.states.popitem(last=False)

    def latest(self, store: ObjectStore, key: str) -> tuple[int, Any] | None:
        with self.lock:
            return self.states.get(self._where(store, key))


class _RecentHeads(_Recent):
    """Hash states (copied in and out: callers go on hashing), for appenders."""

    def remember(self, store: ObjectStore, key: str, length: int, hasher) -> None:
        super().remember(store, key, length, hasher.copy())

    def latest(self, store: ObjectStore, key: str) -> tuple[int, Any] | None:
        known = super().latest(store, key)
        return (known[0], known[1].copy()) if known is not None else None


def _read_forward(store: ObjectStore, key: str, start: int, length: int) -> bytes | None:
    """Tokens [start, length) of the log's own segments; None when they do not line up
    with `length`. The segment at `start` is read by its known key: usually (a turn's
    reader) it is the only one. When more follow (a process that last saw this log many
    turns ago), their positions are listed and they are read in parallel, not one
    request after another."""
    if start == length:
        return b""
    try:
        first = store.get_bytes(_segment_key(key, start))
    except ObjectNotFound:
        return None
    if not first or len(first) % 4:
        return None
    position = start + len(first) // 4
    if position >= length:
        return first if position == length else None
    try:
        rest = _collect_segments(store, key, position, length)
    except (ObjectNotFound, CorruptObject):
        return None
    return first + rest if position + len(rest) // 4 == length else None


_HEADS = _RecentHeads(kept=4096)
# The token bytes themselves, for readers that need the ids (the rollout node, turn after
# turn); fewer kept, as each holds a context (a 32k-token one is 128 KiB).
_PREFIXES = _Recent(kept=256)


def read_prefix(store: ObjectStore, ref: PrefixRef) -> list[int]:
    """Exactly the first `ref.length` tokens of `ref.key`, checked against `ref.sha256`.

    Raises `CorruptObject` when the log holds fewer tokens, a segment is missing or
    damaged, or the prefix's hash is not the ref's.
    """
    return decode_tokens(_read_remembered(store, ref))


def remember_tokens(store: ObjectStore, ref: PrefixRef, tokens: list[int]) -> None:
    """Keep what a writer just appended (`tokens` are `ref`'s whole prefix) for the next
    `read_prefix` of the same log in this process."""
    _PREFIXES.remember(store, ref.key.rstrip("/"), ref.length, encode_tokens(tokens))


def _read_remembered(store: ObjectStore, ref: PrefixRef) -> bytes:
    """`_read_verified`, reading only the segments after the longest prefix of the same log
    this process read before (segments are write-once; the whole is still checked against
    `ref.sha256`): a node that serves a trajectory's turns reads each turn's new segments,
    not its whole context."""
    key = ref.key.rstrip("/")
    seen = _PREFIXES.latest(store, key)
    if seen is not None and seen[0] <= ref.length:
        tail = _read_forward(store, key, seen[0], ref.length)
        if tail is not None:
            data = seen[1] + tail
            if hashlib.sha256(data).hexdigest() == ref.sha256:
                _PREFIXES.remember(store, key, ref.length, data)
                return data
    data = _read_verified(store, ref)
    _PREFIXES.remember(store, key, ref.length, data)
    return data


def read_marks(store: ObjectStore, ref: PrefixRef) -> list[Span]:
    """Where the first `ref.length` tokens of `ref.key` came from: the maximal runs of one
    source, in order, covering exactly [0, ref.length).

    Reads the manifests and one HEAD per segment (in parallel), not the tokens: it checks
    that the segments line up and reach `ref.length`, not `ref.sha256` (`read_prefix`
    does). Segments written before marks existed read as "env". Raises `CorruptObject`
    when the log holds fewer tokens or a segment is missing or carries an unknown mark.
    """
    spans = _marks(store, ref.key, ref.length)
    covered = spans[-1].end if spans else 0
    if covered < ref.length:
        raise CorruptObject(
            f"token log {ref.key!r} holds only {covered} tokens; the ref asks for {ref.length}"
        )
    return _merged(spans)


def loss_mask(spans: Iterable[Span]) -> list[int]:
    """One 0/1 per token of the spans: 1 where the model generated the token (a trainer's
    policy-gradient loss counts those), 0 for the prompt and observations."""
    mask: list[int] = []
    for span in spans:
        mask += [1 if span.source == "model" else 0] * (span.end - span.start)
    return mask


def _marks(store: ObjectStore, key: str, length: int) -> list[Span]:
    """Per-segment spans of the first `length` tokens of the log at `key` (fewer if it is
    shorter), a fork's base first, cut at the fork point."""
    key = key.rstrip("/")
    manifest = _read_manifest(store, key)
    spans: list[Span] = []
    own_start = 0
    if manifest["base"] is not None:
        base = PrefixRef.model_validate(manifest["base"])
        spans = _marks(store, base.key, min(length, base.length))
        if (spans[-1].end if spans else 0) < min(length, base.length):
            return spans
        own_start = base.length
    if length > own_start:
        spans += _segment_marks(store, key, own_start, length)
    return spans


def _segment_marks(store: ObjectStore, key: str, start: int, length: int) -> list[Span]:
    starts = _segment_starts(store, key, start, length)
    with ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="belayer-tokenlog") as pool:
        heads = list(pool.map(lambda s: store.head_metadata(_segment_key(key, s)), starts))
    spans = []
    position = start
    for seg_start, (ref, metadata) in zip(starts, heads, strict=True):
        _check_lines_up(key, seg_start, position, ref.size)
        position += ref.size // 4
        spans.append(Span(seg_start, min(position, length), _source_of(key, seg_start, metadata)))
    return spans


def _source_of(key: str, start: int, metadata: dict[str, str]) -> Source:
    source = metadata.get(_SOURCE_METADATA, UNMARKED_SOURCE)
    if source not in SOURCES:
        raise CorruptObject(f"token log {key!r}: segment at {start} has an unknown source mark {source!r}")
    return source


def _merged(spans: list[Span]) -> list[Span]:
    """Adjacent spans of one source as one span (segment boundaries are not meaningful to
    a trainer, and a fork adds one)."""
    out: list[Span] = []
    for span in spans:
        if out and out[-1].source == span.source and out[-1].end == span.start:
            out[-1] = Span(out[-1].start, span.end, span.source)
        else:
            out.append(span)
    return out


def _read_verified(store: ObjectStore, ref: PrefixRef) -> bytes:
    data = _collect(store, ref.key, ref.length)
    if len(data) < ref.length * 4:
        raise CorruptObject(
            f"token log {ref.key!r} holds only {len(data) // 4} tokens; the ref asks for {ref.length}"
        )
    actual = hashlib.sha256(data).hexdigest()
    if actual != ref.sha256:
        raise CorruptObject(
            f"token log {ref.key!r}: the first {ref.length} tokens hash to {actual}, but the ref says "
            f"{ref.sha256} (the ref belongs to another log or branch, or the log was damaged)"
        )
    return data


def _collect(store: ObjectStore, key: str, length: int) -> bytes:
    """The first `length` tokens of the log at `key` as stored (or fewer if it is shorter)."""
    key = key.rstrip("/")
    manifest = _read_manifest(store, key)
    out = bytearray()
    own_start = 0
    if manifest["base"] is not None:
        base = PrefixRef.model_validate(manifest["base"])
        out += _collect(store, base.key, min(length, base.length))
        if len(out) < min(length, base.length) * 4:
            return bytes(out)
        own_start = base.length
    if length > own_start:
        out += _collect_segments(store, key, own_start, length)
    return bytes(out[: length * 4])


def _collect_segments(store: ObjectStore, key: str, start: int, length: int) -> bytes:
    starts = _segment_starts(store, key, start, length)
    with ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="belayer-tokenlog") as pool:
        blobs = list(pool.map(lambda s: store.get_bytes(_segment_key(key, s)), starts))
    out = bytearray()
    position = start
    for seg_start, blob in zip(starts, blobs, strict=True):
        _check_lines_up(key, seg_start, position, len(blob))
        out += blob
        position += len(blob) // 4
    return bytes(out)


def _segment_starts(store: ObjectStore, key: str, start: int, length: int) -> list[int]:
    """Positions of the log's own segments that start in [start, length) (one LIST call
    per 1000 segments; listing order is position order)."""
    starts = []
    seg_dir = f"{key}/seg/"
    for seg_key in store.list(seg_dir):
        match = _SEGMENT.match(seg_key[len(seg_dir) :])
        if match and start <= int(match.group(1)) < length:
            starts.append(int(match.group(1)))
    return starts


def _check_lines_up(key: str, seg_start: int, position: int, size: int) -> None:
    if seg_start != position:
        raise CorruptObject(
            f"token log {key!r}: segment at position {seg_start} follows tokens ending at {position} "
            "(a segment is missing or overlaps)"
        )
    if size % 4:
        raise CorruptObject(f"token log {key!r}: segment at {seg_start} is not whole uint32 ids")


def _segment_key(key: str, start: int) -> str:
    return f"{key}/seg/{start:012d}.u32"


def _manifest_key(key: str) -> str:
    return f"{key.rstrip('/')}/manifest.json"


def _write_manifest(store: ObjectStore, key: str, *, base: PrefixRef | None) -> None:
    manifest = {"format": FORMAT, "encoding": ENCODING, "base": base.model_dump() if base else None}
    body = json.dumps(manifest, sort_keys=True).encode()
    try:
        store.put_bytes(_manifest_key(key), body, if_absent=True)
    except ObjectConflict:
        raise ObjectConflict(
            f"a different token log already exists at {key!r} (another base); use a new key"
        ) from None


def _read_manifest(store: ObjectStore, key: str) -> dict:
    try:
        body = store.get_bytes(_manifest_key(key))
    except ObjectNotFound:
        raise ObjectNotFound(
            f"no token log at {key!r} (its manifest {_manifest_key(key)!r} is missing)"
        ) from None
    manifest = json.loads(body)
    if manifest.get("format") != FORMAT or manifest.get("encoding") != ENCODING:
        raise CorruptObject(
            f"token log {key!r}: unknown format {manifest.get('format')!r}/{manifest.get('encoding')!r}"
        )
    return manifest
