"""What a trainer needs besides a turn's tokens: each sampled token's logprob and the
weights version that produced it, stored beside the token log, never in a payload.

One object per generated turn, at `<log key>.gen/<start>` (`start` = the position of the
turn's first token in that log, zero-padded like the log's segments), so a trainer can
find it from the log alone and a `GenerationRef` names it with its sha256. Written
create-if-absent after the turn's segment: a segment is write-once, so an object already
at that position describes the same tokens (an earlier attempt of the turn), and the
first writer's record stands, as it does for the segment.

Encoding, all little-endian, no padding:

    b"BLGN" | u32 tokens | u32 runs | runs x (u64 version, u32 count) | tokens x f32 logprob

Versions are stored as runs: a turn is one version unless a publish lands during it.
The logprob of a token is under the distribution it was sampled from (after
temperature, top-p and top-k).

A turn's tokens so far (what a generate heartbeat stores so that a retry resumes
mid-turn) use the same encoding followed by the token ids (`encode_sampled`), so the
resumed tokens keep their logprobs and versions.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from belayer.storage.errors import CorruptObject, ObjectConflict
from belayer.storage.tokenlog import (
    PrefixRef,
    _read_manifest,
    decode_tokens,
    encode_tokens,
    loss_mask,
    read_marks,
)

MAGIC = b"BLGN"
_HEADER = struct.Struct("<4sII")
_RUN = struct.Struct("<QI")


class GenerationRef(BaseModel):
    """The logprobs and versions of tokens [start, start + count) of a token log."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1, description="Object key (relative to the store's key_prefix).")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the stored object.")
    start: int = Field(ge=0, description="Position of the first token in the token log.")
    count: int = Field(ge=1, description="Number of tokens the object describes.")


@dataclass(frozen=True)
class SampledTokens:
    """Tokens the model sampled, each with its logprob and the weights version that produced it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not len(self.tokens) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"{len(self.tokens)} tokens need as many logprobs and versions, "
                f"not {len(self.logprobs)} and {len(self.versions)}"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def __add__(self, other: SampledTokens) -> SampledTokens:
        return SampledTokens(
            self.tokens + other.tokens, self.logprobs + other.logprobs, self.versions + other.versions
        )

    def first(self, count: int) -> SampledTokens:
        return SampledTokens(self.tokens[:count], self.logprobs[:count], self.versions[:count])


def generation_key(log_key: str, start: int) -> str:
    return f"{log_key.rstrip('/')}.gen/{start:012d}"


def distinct_versions(versions: Sequence[int]) -> list[int]:
    """The versions in order of first appearance (what a `GenerateResult` reports)."""
    return list(dict.fromkeys(versions))


def encode_generation(logprobs: Sequence[float], versions: Sequence[int]) -> bytes:
    if len(logprobs) != len(versions):
        raise ValueError(f"{len(logprobs)} logprobs but {len(versions)} versions")
    runs = _runs(versions)
    packed = array("f", logprobs)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return (
        _HEADER.pack(MAGIC, len(logprobs), len(runs))
        + b"".join(_RUN.pack(version, count) for version, count in runs)
        + packed.tobytes()
    )


def decode_generation(data: bytes) -> tuple[list[float], list[int]]:
    """(logprobs, one version per token); `ValueError` unless `data` is exactly one encoding."""
    logprobs, versions, end = _parse(data)
    if end != len(data):
        raise ValueError(f"{len(data) - end} bytes after the encoded generation")
    return logprobs, versions


def encode_sampled(sampled: SampledTokens) -> bytes:
    return encode_generation(sampled.logprobs, sampled.versions) + encode_tokens(sampled.tokens)


def decode_sampled(data: bytes) -> SampledTokens:
    """Inverse of `encode_sampled`; `ValueError` when `data` is not one."""
    logprobs, versions, end = _parse(data)
    tokens = decode_tokens(data[end:])
    if len(tokens) != len(logprobs):
        raise ValueError(f"{len(tokens)} token ids after {len(logprobs)} logprobs")
    return SampledTokens(tokens, logprobs, versions)


def write_generation(
    store, log_key: str, start: int, sampled: SampledTokens
) -> tuple[GenerationRef, list[int]]:
    """Store the logprobs and versions of the turn whose tokens were just appended to
    `log_key` at `start`; returns the ref and the turn's distinct versions.

    When an earlier attempt of the turn already stored them (same tokens: the segment is
    write-once) its object stands, and what it says is returned: one record per
    position, even if the attempts ran on different weights versions.
    """
    if not sampled:
        raise ValueError("a generation needs at least one token")
    key = generation_key(log_key, start)
    data = encode_generation(sampled.logprobs, sampled.versions)
    versions = sampled.versions
    try:
        sha256 = store.put_bytes(key, data, if_absent=True).sha256
    except ObjectConflict:
        data = store.get_bytes(key)  # checked against its recorded sha256
        sha256 = hashlib.sha256(data).hexdigest()
        versions = _decoded(key, data, len(sampled))[1]
    ref = GenerationRef(key=key, sha256=sha256, start=start, count=len(sampled))
    return ref, distinct_versions(versions)


def read_generation(store, ref: GenerationRef) -> tuple[list[float], list[int]]:
    """(logprobs, one version per token) of the `ref.count` tokens `ref` describes, checked
    against `ref.sha256`; `CorruptObject` when the object does not verify or decode."""
    return _decoded(ref.key, store.get_bytes(ref.key, expected_sha256=ref.sha256), ref.count)


def _decoded(key: str, data: bytes, count: int) -> tuple[list[float], list[int]]:
    try:
        logprobs, versions = decode_generation(data)
    except ValueError as exc:
        raise CorruptObject(f"{key!r} is not an encoded generation: {exc}") from None
    if len(logprobs) != count:
        raise CorruptObject(f"{key!r} describes {len(logprobs)} tokens, not {count}")
    return logprobs, versions


def _runs(versions: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for version in versions:
        if runs and runs[-1][0] == version:
            runs[-1] = (version, runs[-1][1] + 1)
        else:
            runs.append((version, 1))
    return runs


def _parse(data: bytes) -> tuple[list[float], list[int], int]:
    """(logprobs, versions, end offset) of the encoded generation at the start of `data`."""
    if len(data) < _HEADER.size:
        raise ValueError(f"{len(data)} bytes is shorter than the header")
    magic, tokens, run_count = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"header {magic!r} is not {MAGIC!r}")
    runs_end = _HEADER.size + run_count * _RUN.size
    end = runs_end + tokens * 4
    if len(data) < end:
        raise ValueError(f"{len(data)} bytes, but the header announces {end}")
    versions: list[int] = []
    for version, count in _RUN.iter_unpack(data[_HEADER.size : runs_end]):
        versions += [version] * count
    if len(versions) != tokens:
        raise ValueError(f"version runs cover {len(versions)} tokens, not {tokens}")
    logprobs = array("f")
    logprobs.frombytes(data[runs_end:end])
    if sys.byteorder == "big":  # pragma: no cover
        logprobs.byteswap()
    return logprobs.tolist(), versions, end


def read_generations(store, ref: PrefixRef) -> tuple[list[int | None], list[float | None]]:
    """Per position of the prefix `ref`: (weights version, logprob) of every model token,
    None for the prompt and observations; what a trainer needs beside the tokens.

    Follows a fork's manifest to its base, whose generation objects describe the turns
    before the fork (each cut at the fork point); only objects that start inside the
    prefix count. Every model span of the log must be covered by generation records
    exactly (no gap, no overlap, nothing over environment tokens), else `CorruptObject`:
    a trainer must never guess which policy sampled a token.
    """
    versions: list[int | None] = [None] * ref.length
    logprobs: list[float | None] = [None] * ref.length
    for key, start, turn_logprobs, turn_versions, end in _generations_of(store, ref.key, 0, ref.length):
        for position in range(start, end):
            if versions[position] is not None:
                raise CorruptObject(
                    f"token log {ref.key!r}: two generation records describe position {position} "
                    f"(the second is {key!r})"
                )
            versions[position] = turn_versions[position - start]
            logprobs[position] = turn_logprobs[position - start]
    _check_covers(ref.key, loss_mask(read_marks(store, ref)), versions)
    return versions, logprobs


def _generations_of(store, log_key: str, start: int, end: int):
    """(object key, start, logprobs, versions, end) of the generation objects of the log
    at `log_key` (and its fork bases) that describe positions in [start, end), each cut
    at `end`."""
    log_key = log_key.rstrip("/")
    manifest = _read_manifest(store, log_key)
    own_start = 0
    if manifest["base"] is not None:
        base = PrefixRef.model_validate(manifest["base"])
        yield from _generations_of(store, base.key, start, min(end, base.length))
        own_start = base.length
    starts = [s for s in _generation_starts(store, log_key) if max(start, own_start) <= s < end]
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="belayer-generation") as pool:
        blobs = list(pool.map(lambda s: store.get_bytes(generation_key(log_key, s)), starts))
    for turn_start, data in zip(starts, blobs, strict=True):
        key = generation_key(log_key, turn_start)
        try:
            turn_logprobs, turn_versions = decode_generation(data)
        except ValueError as exc:
            raise CorruptObject(f"{key!r} is not an encoded generation: {exc}") from None
        yield key, turn_start, turn_logprobs, turn_versions, min(end, turn_start + len(turn_versions))


def _generation_starts(store, log_key: str) -> list[int]:
    folder = f"{log_key}.gen/"
    return [int(k[len(folder) :]) for k in store.list(folder) if k[len(folder) :].isdigit()]


def _check_covers(log_key: str, mask: list[int], versions: list[int | None]) -> None:
    """Generation records must cover exactly the model-generated positions."""
    for position, (model, version) in enumerate(zip(mask, versions, strict=True)):
        if model and version is None:
            raise CorruptObject(
                f"token log {log_key!r}: model token at position {position} has no generation record "
                "(its turn's logprobs and weights version are missing)"
            )
        if not model and version is not None:
            raise CorruptObject(
                f"token log {log_key!r}: a generation record describes position {position}, which the "
                "log marks as environment tokens"
            )
