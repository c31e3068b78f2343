"""A turn's logprobs and weights versions beside its token log: encoding, verified reads,
one record per position."""

from __future__ import annotations

import struct

import pytest

from belayer.storage import CorruptObject, ObjectStore
from belayer.storage.generation import (
    GenerationRef,
    SampledTokens,
    decode_generation,
    decode_sampled,
    encode_generation,
    encode_sampled,
    generation_key,
    read_generation,
    read_generations,
    write_generation,
)
from belayer.storage.tokenlog import TokenLog, prefix_sha256

from .helpers import RawBucket

SAMPLED = SampledTokens(
    tokens=[11, 12, 13, 14, 15],
    logprobs=[-0.5, -1.25, -0.0, -3.0, -0.125],  # exact in float32
    versions=[3, 3, 3, 4, 4],
)

# ---- encoding (no server) ------------------------------------------------------------


def test_encoding_is_a_header_version_runs_then_float32_logprobs():
    data = encode_generation(SAMPLED.logprobs, SAMPLED.versions)
    assert data[:12] == struct.pack("<4sII", b"BLGN", 5, 2)
    assert data[12:36] == struct.pack("<QIQI", 3, 3, 4, 2)
    assert data[36:] == struct.pack("<5f", *SAMPLED.logprobs)
    assert decode_generation(data) == (SAMPLED.logprobs, SAMPLED.versions)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[:-1],  # truncated
        lambda d: d + b"\0",  # trailing bytes
        lambda d: b"XXXX" + d[4:],  # not ours
        lambda d: d[:12] + struct.pack("<QI", 3, 2) + d[24:],  # runs cover 4 of 5 tokens
    ],
)
def test_damaged_encodings_are_refused(damage):
    with pytest.raises(ValueError):
        decode_generation(damage(encode_generation(SAMPLED.logprobs, SAMPLED.versions)))


def test_tokens_so_far_round_trip_with_their_logprobs_and_versions():
    assert decode_sampled(encode_sampled(SAMPLED)) == SAMPLED
    assert decode_sampled(encode_sampled(SAMPLED.first(2))) == SampledTokens([11, 12], [-0.5, -1.25], [3, 3])
    assert SAMPLED.first(2) + SAMPLED.first(1) == SampledTokens([11, 12, 11], [-0.5, -1.25, -0.5], [3, 3, 3])
    with pytest.raises(ValueError, match="token ids after"):
        decode_sampled(encode_sampled(SAMPLED)[:-4])
    with pytest.raises(ValueError, match="as many logprobs"):
        SampledTokens([1, 2], [0.0], [1, 1])


# ---- against SeaweedFS -----------------------------------------------------------------


@pytest.fixture
def store(storage_config):
    with ObjectStore(storage_config) as store:
        yield store


def test_written_beside_the_log_and_read_back_verified(store):
    ref, versions = write_generation(store, "traj/g/v0", 40, SAMPLED)
    assert ref.key == generation_key("traj/g/v0", 40) == "traj/g/v0.gen/000000000040"
    assert (ref.start, ref.count, versions) == (40, 5, [3, 4])
    assert read_generation(store, ref) == (SAMPLED.logprobs, SAMPLED.versions)
    assert len(GenerationRef.model_validate_json(ref.model_dump_json()).model_dump_json()) < 200


def test_a_corrupt_or_mismatched_object_is_refused(store, storage_config):
    ref, _ = write_generation(store, "traj/gc", 0, SAMPLED)
    with pytest.raises(CorruptObject):
        read_generation(store, ref.model_copy(update={"sha256": "0" * 64}))
    with pytest.raises(CorruptObject, match="describes 5 tokens, not 6"):
        read_generation(store, ref.model_copy(update={"count": 6}))
    damaged = bytearray(encode_generation(SAMPLED.logprobs, SAMPLED.versions))
    damaged[-1] ^= 0xFF
    RawBucket(storage_config).overwrite(ref.key, bytes(damaged))  # keeps the recorded sha256
    with pytest.raises(CorruptObject):
        read_generation(store, ref)


def test_the_first_record_of_a_position_stands(store):
    """A retried turn on newer weights that sampled the same tokens: the earlier attempt's
    record stays, and the retry reports what it says."""
    first, _ = write_generation(store, "traj/gr", 7, SAMPLED)
    assert write_generation(store, "traj/gr", 7, SAMPLED) == (first, [3, 4])
    newer = SampledTokens(SAMPLED.tokens, [-0.25] * 5, [5] * 5)
    assert write_generation(store, "traj/gr", 7, newer) == (first, [3, 4])
    assert read_generation(store, first) == (SAMPLED.logprobs, SAMPLED.versions)


def _turn(log: TokenLog, tokens: list[int], version: int, logprob: float = -0.5):
    """Append one model turn and its generation record, as the engine does."""
    start = log.head.length
    log.append(tokens, source="model")
    write_generation(
        log.store, log.key, start, SampledTokens(tokens, [logprob] * len(tokens), [version] * len(tokens))
    )
    return log.head


def test_per_position_versions_and_logprobs_of_a_prefix(store):
    log = TokenLog.create(store, "traj/rg")
    log.append([1, 2, 3], source="env")
    _turn(log, [4, 5], 2, -0.25)
    log.append([6], source="env")
    head = _turn(log, [7, 8, 9], 3, -1.5)
    versions, logprobs = read_generations(store, head)
    assert versions == [None, None, None, 2, 2, None, 3, 3, 3]
    assert logprobs == [None, None, None, -0.25, -0.25, None, -1.5, -1.5, -1.5]
    # A shorter prefix ends inside the last turn: that turn is cut, later ones ignored.
    cut = log.head.model_copy(update={"length": 7, "sha256": prefix_sha256([1, 2, 3, 4, 5, 6, 7])})
    assert read_generations(store, cut) == (
        [None] * 3 + [2, 2, None, 3],
        [None] * 3 + [-0.25] * 2 + [None, -1.5],
    )


def test_a_fork_reads_the_earlier_turns_from_its_base(store):
    base = TokenLog.create(store, "traj/rb")
    base.append([1, 2], source="env")
    _turn(base, [3, 4, 5, 6], 2, -0.5)
    _turn(base, [7], 2, -0.5)  # after the fork point: not part of the fork
    fork_point = base.head.model_copy(update={"length": 4, "sha256": prefix_sha256([1, 2, 3, 4])})
    fork = TokenLog.fork(store, fork_point, "traj/rb-fork")
    _turn(fork, [9, 10], 3, -2.0)
    fork.append([11], source="env")
    versions, logprobs = read_generations(store, fork.head)
    assert versions == [None, None, 2, 2, 3, 3, None]
    assert logprobs == [None, None, -0.5, -0.5, -2.0, -2.0, None]


def test_a_model_turn_without_its_record_is_refused(store):
    log = TokenLog.create(store, "traj/rm")
    log.append([1, 2], source="env")
    log.append([3, 4], source="model")
    with pytest.raises(CorruptObject, match="position 2 has no generation record"):
        read_generations(store, log.head)


def test_a_record_over_environment_tokens_is_refused(store):
    log = TokenLog.create(store, "traj/re")
    log.append([1, 2], source="env")
    write_generation(store, log.key, 0, SampledTokens([1, 2], [-1.0, -1.0], [2, 2]))
    with pytest.raises(CorruptObject, match="marks as environment tokens"):
        read_generations(store, log.head)
