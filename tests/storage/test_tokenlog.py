"""Token logs: canonical encoding, exact prefixes by reference, idempotent appends, forks."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from belayer.storage import CorruptObject, ObjectConflict, ObjectNotFound, ObjectStore
from belayer.storage.tokenlog import (
    PrefixRef,
    Span,
    TokenLog,
    _segment_key,
    decode_tokens,
    encode_tokens,
    loss_mask,
    prefix_ref,
    prefix_sha256,
    read_marks,
    read_prefix,
)

from .helpers import RawBucket

# ---- encoding (no server) ------------------------------------------------------------


def test_canonical_encoding_is_little_endian_uint32():
    assert encode_tokens([1, 256, 2**32 - 1]) == struct.pack("<3I", 1, 256, 2**32 - 1)
    assert prefix_sha256([1, 2]) == hashlib.sha256(struct.pack("<2I", 1, 2)).hexdigest()
    assert prefix_sha256([]) == hashlib.sha256(b"").hexdigest()
    assert decode_tokens(encode_tokens([5, 0, 7])) == [5, 0, 7]


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"], [1.5]])
def test_out_of_range_token_ids_are_refused(bad):
    with pytest.raises(ValueError):
        encode_tokens(bad)


def test_loss_mask_counts_only_model_tokens():
    spans = [Span(0, 3, "env"), Span(3, 5, "model"), Span(5, 6, "env")]
    assert loss_mask(spans) == [0, 0, 0, 1, 1, 0]
    assert loss_mask([]) == []


def test_prefix_ref_is_small_and_serialisable():
    ref = prefix_ref("tokenlogs/t1", list(range(100_000)))
    payload = ref.model_dump_json()
    assert len(payload) < 200
    assert PrefixRef.model_validate_json(payload) == ref


# ---- against SeaweedFS -----------------------------------------------------------------


@pytest.fixture
def store(storage_config):
    with ObjectStore(storage_config) as store:
        yield store


def turns(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 200_000) for _ in range(rng.randrange(1, 400))] for _ in range(count)]


def test_many_appends_read_back_as_exact_prefixes(store):
    log = TokenLog.create(store, "traj/42")
    everything: list[int] = []
    refs = []
    for turn in turns(150):
        ref = log.append(turn, source="env")
        everything += turn
        assert ref == PrefixRef(key="traj/42", length=len(everything), sha256=prefix_sha256(everything))
        refs.append(ref)
    assert read_prefix(store, refs[-1]) == everything
    for ref in (refs[0], refs[1], refs[74], refs[148]):  # shorter prefixes than the latest
        assert read_prefix(store, ref) == everything[: ref.length]
    for length in (0, 1, 7, refs[10].length + 3, len(everything) - 1):  # cuts inside a segment
        assert log.read_prefix(prefix_ref("traj/42", everything[:length])) == everything[:length]
    assert log.append([], source="env") == refs[-1]


def test_wrong_hash_or_length_is_refused(store):
    log = TokenLog.create(store, "traj/h")
    log.append([1, 2, 3], source="env")
    ref = log.append([4, 5], source="env")
    with pytest.raises(CorruptObject, match="hash to"):
        read_prefix(store, ref.model_copy(update={"sha256": prefix_sha256([1, 2, 3, 4, 6])}))
    with pytest.raises(CorruptObject, match="hash to"):
        read_prefix(store, ref.model_copy(update={"length": 4}))  # the hash is of 5 tokens
    with pytest.raises(CorruptObject, match="holds only 5 tokens"):
        read_prefix(store, prefix_ref("traj/h", [1, 2, 3, 4, 5, 6]))
    with pytest.raises(ObjectNotFound, match="no token log"):
        read_prefix(store, prefix_ref("traj/none", [1]))


def test_retried_append_is_idempotent_and_divergence_conflicts(store):
    first = TokenLog.create(store, "traj/r")
    ref1 = first.append([10, 11], source="env")
    ref2 = first.append([12], source="env")
    # A retried activity replays from the last ref it knew: same tokens succeed...
    retried = TokenLog.resume(store, ref1)
    assert retried.append([12], source="env") == ref2
    # ...different tokens at a taken position are refused, never written over.
    other = TokenLog.resume(store, ref1)
    with pytest.raises(ObjectConflict, match="fork"):
        other.append([99], source="env")
    assert read_prefix(store, ref2) == [10, 11, 12]
    # Re-creating the same log is harmless, and so is replaying it from the start.
    again = TokenLog.create(store, "traj/r")
    assert again.append([10, 11], source="env") == ref1


def test_fork_diverges_without_copying(store, storage_config):
    log = TokenLog.create(store, "traj/f/b0")
    log.append([1, 2, 3], source="env")
    cut = log.append([4, 5, 6], source="env")
    log.append([7, 8], source="env")
    branch = TokenLog.fork(store, prefix_ref("traj/f/b0", [1, 2, 3, 4]), "traj/f/b1")
    assert branch.head.length == 4
    ref = branch.append([40, 41], source="env")
    assert read_prefix(store, ref) == [1, 2, 3, 4, 40, 41]
    assert read_prefix(store, prefix_ref("traj/f/b1", [1, 2])) == [1, 2]
    assert read_prefix(store, cut) == [1, 2, 3, 4, 5, 6]  # the base is untouched
    fork_of_fork = TokenLog.fork(store, ref, "traj/f/b2")
    assert read_prefix(store, fork_of_fork.append([9], source="env")) == [1, 2, 3, 4, 40, 41, 9]
    with pytest.raises(ObjectConflict, match="different token log"):
        TokenLog.fork(store, cut, "traj/f/b1")
    segments = [k for k in RawBucket(storage_config).all_keys() if k.startswith("traj/f/b1/seg/")]
    assert segments == ["traj/f/b1/seg/000000000004.u32"]


def test_damaged_or_missing_segments_are_detected(store, storage_config):
    raw = RawBucket(storage_config)
    log = TokenLog.create(store, "traj/d")
    log.append([1, 2, 3], source="env")
    log.append([4, 5], source="env")
    ref = log.append([6], source="env")
    raw.overwrite("traj/d/seg/000000000003.u32", encode_tokens([4, 9]))  # keeps the old sha256
    with pytest.raises(CorruptObject, match="corrupt"):
        read_prefix(store, ref)
    assert read_prefix(store, prefix_ref("traj/d", [1, 2, 3])) == [1, 2, 3]  # not needed, not read
    raw.client.delete_object(Bucket=storage_config.bucket, Key=raw.full("traj/d/seg/000000000003.u32"))
    with pytest.raises(CorruptObject, match="missing or overlaps"):
        read_prefix(store, ref)


def test_manifest_stays_small_with_many_turns(store, storage_config):
    log = TokenLog.create(store, "traj/m")
    for turn in turns(40, seed=3):
        log.append(turn, source="env")
    manifest = RawBucket(storage_config).head("traj/m/manifest.json")
    assert manifest["ContentLength"] < 200


class CountingStore:
    """The store, counting the reads a resume makes."""

    def __init__(self, inner):
        self.inner, self.reads = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_bytes(self, *args, **kwargs):
        self.reads += 1
        return self.inner.get_bytes(*args, **kwargs)


def test_resuming_the_last_append_of_this_process_reads_nothing(store):
    log = TokenLog.create(store, "traj/long")
    for turn in range(40):
        head = log.append([turn, turn + 1], source="env")
    counting = CountingStore(store)
    resumed = TokenLog.resume(counting, head)
    assert counting.reads == 0 and resumed.head == head
    after = resumed.append([7], source="env")
    assert after == prefix_ref("traj/long", read_prefix(store, head) + [7])
    # A ref this process never appended is read and verified as before.
    older = prefix_ref("traj/long", read_prefix(store, head)[:21])  # not an append boundary
    TokenLog.resume(counting, older)
    assert counting.reads > 0


def test_resuming_after_another_process_appended_reads_only_the_new_segments(store):
    log = TokenLog.create(store, "traj/shared")
    for turn in range(10):
        log.append([turn, turn], source="env")
    tokens = read_prefix(store, log.head)
    for turn in range(3):  # another process (the engine) appends three turns
        store.put_bytes(_segment_key("traj/shared", len(tokens)), encode_tokens([9, turn]), if_absent=True)
        tokens += [9, turn]
    counting = CountingStore(store)
    resumed = TokenLog.resume(counting, prefix_ref("traj/shared", tokens))
    assert counting.reads == 3
    # A ref whose hash does not match what the segments say is refused, not trusted.
    with pytest.raises(CorruptObject):
        TokenLog.resume(counting, PrefixRef(key="traj/shared", length=len(tokens), sha256="0" * 64))
    assert resumed.append([1], source="env").length == len(tokens) + 1


def test_reading_a_longer_prefix_of_a_log_read_before_reads_only_its_new_segments(store):
    """The rollout node reads a trajectory's context every turn: after the first read it
    fetches the turn's new segments (its own tokens, the observation), not the context."""
    log = TokenLog.create(store, "traj/reader")
    for turn in range(30):
        log.append([turn, turn + 1], source="env")
    tokens = read_prefix(store, log.head)
    log.append([5, 5, 5], source="model")
    longer = log.append([6], source="env")
    counting = CountingStore(store)
    assert read_prefix(counting, longer) == tokens + [5, 5, 5, 6]
    assert counting.reads == 2
    # what the segments say must still hash to the ref: a wrong one is refused, not trusted
    with pytest.raises(CorruptObject):
        read_prefix(counting, PrefixRef(key="traj/reader", length=longer.length, sha256="0" * 64))


def test_a_reader_many_segments_behind_reads_them_all_and_a_missing_one_is_caught(store):
    """The trajectory worker appends a run's last observation after seeing only its prompt:
    the segments in between are listed and read together, each checked to line up."""
    log = TokenLog.create(store, "traj/behind")
    prompt = log.append([1, 2, 3], source="env")
    assert read_prefix(store, prompt) == [1, 2, 3]  # this process remembers the prompt
    for turn in range(20):
        log.append([turn, turn + 1, turn + 2], source="model" if turn % 2 else "env")
    expected = [1, 2, 3] + [t for turn in range(20) for t in (turn, turn + 1, turn + 2)]
    counting = CountingStore(store)
    assert read_prefix(counting, log.head) == expected
    assert counting.reads == 20  # the new segments only: neither the prompt nor the manifest again
    assert TokenLog.resume(store, log.head).append([4], source="env").length == len(expected) + 1

    later = TokenLog.create(store, "traj/gap")
    seen = later.append([1], source="env")
    assert read_prefix(store, seen) == [1]
    for turn in range(5):
        later.append([turn], source="env")
    store.delete(_segment_key("traj/gap", 3))
    with pytest.raises(CorruptObject):
        read_prefix(store, later.head)


# ---- source marks ------------------------------------------------------------------------


def a_turn_log(store, key: str) -> list[PrefixRef]:
    """prompt (env) | turn (model) | observation (env) | turn (model); the ref after each."""
    log = TokenLog.create(store, key)
    return [
        log.append([1, 2, 3], source="env"),
        log.append([4, 5, 6, 7], source="model"),
        log.append([8, 9], source="env"),
        log.append([10, 11, 12], source="model"),
    ]


def test_marks_say_which_tokens_the_model_generated(store):
    refs = a_turn_log(store, "traj/marks")
    spans = read_marks(store, refs[-1])
    assert spans == [Span(0, 3, "env"), Span(3, 7, "model"), Span(7, 9, "env"), Span(9, 12, "model")]
    assert loss_mask(spans) == [0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    assert len(loss_mask(spans)) == refs[-1].length
    # A shorter prefix, ending inside a segment, keeps the part of the span it holds.
    five = prefix_ref("traj/marks", [1, 2, 3, 4, 5])
    assert read_marks(store, five) == [Span(0, 3, "env"), Span(3, 5, "model")]
    assert read_marks(store, prefix_ref("traj/marks", [])) == []


def test_a_context_cut_keeps_the_marks_of_what_it_keeps(store):
    """The trajectory's cut: a new log forked at the end of a turn, continued with an
    observation and the next turns."""
    refs = a_turn_log(store, "traj/cut/v0")
    branch = TokenLog.fork(store, refs[1], "traj/cut/v1")
    branch.append([20, 21], source="env")
    head = branch.append([22], source="model")
    assert read_marks(store, head) == [
        Span(0, 3, "env"),
        Span(3, 7, "model"),
        Span(7, 9, "env"),
        Span(9, 10, "model"),
    ]
    assert read_marks(store, refs[-1])[-1] == Span(9, 12, "model")  # the old branch is untouched


def test_a_fork_inside_a_segment_keeps_the_truncated_span(store):
    a_turn_log(store, "traj/fk/b0")
    inside_model_turn = prefix_ref("traj/fk/b0", [1, 2, 3, 4, 5])
    branch = TokenLog.fork(store, inside_model_turn, "traj/fk/b1")
    head = branch.append([30, 31], source="model")  # the same source: one span across the fork
    assert read_marks(store, head) == [Span(0, 3, "env"), Span(3, 7, "model")]
    twice = TokenLog.fork(store, prefix_ref("traj/fk/b1", [1, 2, 3, 4, 5, 30]), "traj/fk/b2")
    head = twice.append([40], source="env")
    assert read_marks(store, head) == [Span(0, 3, "env"), Span(3, 6, "model"), Span(6, 7, "env")]
    assert loss_mask(read_marks(store, head)) == [0, 0, 0, 1, 1, 1, 0]


def test_segments_written_before_marks_existed_read_as_env(store):
    """A log written by the old code (segments without a mark), continued by the new."""
    TokenLog.create(store, "traj/old")
    store.put_bytes(_segment_key("traj/old", 0), encode_tokens([1, 2]), if_absent=True)
    store.put_bytes(_segment_key("traj/old", 2), encode_tokens([3, 4, 5]), if_absent=True)
    old = prefix_ref("traj/old", [1, 2, 3, 4, 5])
    assert read_marks(store, old) == [Span(0, 5, "env")]
    head = TokenLog.resume(store, old).append([6], source="model")
    assert read_marks(store, head) == [Span(0, 5, "env"), Span(5, 6, "model")]


def test_a_retry_that_names_another_source_conflicts(store):
    log = TokenLog.create(store, "traj/src")
    first = log.append([1, 2], source="env")
    log.append([3, 4], source="model")
    assert TokenLog.resume(store, first).append([3, 4], source="model").length == 4  # the same retry
    with pytest.raises(ObjectConflict, match="another source"):
        TokenLog.resume(store, first).append([3, 4], source="env")
    with pytest.raises(ValueError, match="source"):
        log.append([5], source="observation")


def test_marks_of_a_short_log_or_an_unknown_mark_are_refused(store):
    refs = a_turn_log(store, "traj/bad")
    with pytest.raises(CorruptObject, match="holds only 12 tokens"):
        read_marks(store, prefix_ref("traj/bad", list(range(13))))
    store.put_bytes(_segment_key("traj/bad", 12), encode_tokens([0]), metadata={"source": "tool"})
    with pytest.raises(CorruptObject, match="unknown source mark 'tool'"):
        read_marks(store, prefix_ref("traj/bad", read_prefix(store, refs[-1]) + [0]))


def test_reading_marks_costs_no_token_reads(store):
    refs = a_turn_log(store, "traj/cheap")
    counting = CountingStore(store)
    read_marks(counting, refs[-1])
    assert counting.reads == 1  # the manifest; each segment's mark comes with a HEAD
