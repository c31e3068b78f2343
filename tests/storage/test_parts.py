"""Pure pieces of the storage layer, by property: part regrouping and token encoding."""

from __future__ import annotations

import hashlib
import io

from hypothesis import given
from hypothesis import strategies as st

from belayer.storage.store import _parts
from belayer.storage.tokenlog import decode_tokens, encode_tokens, prefix_sha256

chunk_lists = st.lists(st.binary(max_size=40), max_size=30)


@given(chunks=chunk_lists, part_size=st.integers(min_value=1, max_value=17))
def test_iterables_regroup_into_exact_parts(chunks, part_size):
    parts = [bytes(p) for p in _parts(iter(chunks), part_size)]
    assert b"".join(parts) == b"".join(chunks)
    assert all(len(p) == part_size for p in parts[:-1])
    assert all(0 < len(p) <= part_size for p in parts)


class ShortReads(io.RawIOBase):
    """A pipe-like file: readinto answers at most `step` bytes at a time."""

    def __init__(self, data: bytes, step: int):
        self.data, self.step, self.pos = data, step, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(self.step, len(buffer), len(self.data) - self.pos)
        buffer[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


@given(data=st.binary(max_size=300), part_size=st.integers(1, 64), step=st.integers(1, 50))
def test_files_with_short_reads_regroup_into_exact_parts(data, part_size, step):
    parts = [bytes(p) for p in _parts(ShortReads(data, step), part_size)]
    assert b"".join(parts) == data
    assert all(len(p) == part_size for p in parts[:-1])


@given(tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200), cut=st.integers(0, 200))
def test_token_encoding_round_trips_and_prefix_hashes_are_incremental(tokens, cut):
    assert decode_tokens(encode_tokens(tokens)) == tokens
    head, tail = tokens[:cut], tokens[cut:]
    hasher = hashlib.sha256(encode_tokens(head))
    hasher.update(encode_tokens(tail))
    assert hasher.hexdigest() == prefix_sha256(tokens)
