"""Faults injected between ObjectStore and the real SeaweedFS: lost answers, refusals, SlowDown.

Each scenario is one a real network produces; the injection only makes it happen on
the call we want. The server and its state are real.
"""

from __future__ import annotations

import io
import random

import pytest

from belayer.storage import ObjectStore, TransientStorageError
from belayer.storage.retry import RetryPolicy
from belayer.storage.s3client import make_s3_client

from .helpers import CountingSleep, FaultyClient, RawBucket

MiB = 1 << 20


def faulty_store(cfg, plan, *, max_attempts: int = 5) -> tuple[ObjectStore, FaultyClient, CountingSleep]:
    client = FaultyClient(make_s3_client(cfg), plan)
    sleep = CountingSleep()
    return (
        ObjectStore(cfg, client=client, retry=RetryPolicy(max_attempts=max_attempts, sleep=sleep)),
        client,
        sleep,
    )


@pytest.fixture
def cfg(storage_config):
    return storage_config.model_copy(update={"part_size_mb": 5})


def data(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.mark.parametrize("if_absent", [False, True])
def test_lost_answer_to_a_put_is_retried_idempotently(cfg, if_absent):
    store, client, sleep = faulty_store(cfg, {"put_object": ["lost"]})
    ref = store.put_bytes("k", b"payload", if_absent=if_absent)
    assert client.calls["put_object"] == 2 and len(sleep.delays) == 1
    assert store.get_bytes("k", expected_sha256=ref.sha256) == b"payload"


@pytest.mark.parametrize("if_absent", [False, True])
def test_lost_answer_to_complete_multipart_counts_as_done(cfg, if_absent):
    store, client, _ = faulty_store(cfg, {"complete_multipart_upload": ["lost"]})
    body = data(11 * MiB, seed=1)
    ref = store.upload_stream("big", io.BytesIO(body), if_absent=if_absent)
    assert client.calls["complete_multipart_upload"] == 2
    assert store.get_bytes("big") == body and store.head("big") == ref
    raw = RawBucket(cfg)
    assert raw.open_uploads() == [] and len(raw.records()) == 1


def test_refused_and_throttled_parts_are_retried(cfg):
    plan = {"upload_part": [None, "refused", "slowdown", "lost"], "create_multipart_upload": ["slowdown"]}
    store, client, sleep = faulty_store(cfg, plan)
    body = data(16 * MiB, seed=2)
    ref = store.upload_stream("big", io.BytesIO(body))
    assert client.calls["upload_part"] == 4 + 3  # part 2: refused, throttled, answer lost, then served
    assert len(sleep.delays) == 4
    assert store.get_bytes("big", expected_sha256=ref.sha256) == body


def test_part_that_keeps_failing_aborts_the_upload(cfg):
    store, client, sleep = faulty_store(cfg, {"upload_part": [None] + ["refused"] * 3}, max_attempts=3)
    with pytest.raises(TransientStorageError, match="upload-part 2.*gave up after 3 attempts"):
        store.upload_stream("big", io.BytesIO(data(16 * MiB, seed=3)))
    raw = RawBucket(cfg)
    assert raw.open_uploads() == [] and raw.records() == [] and not store.exists("big")


def test_lost_answer_while_downloading_resumes(cfg):
    body = data(3 * MiB, seed=4)
    with ObjectStore(cfg) as plain:
        plain.put_bytes("k", body)
    store, client, _ = faulty_store(cfg, {"get_object": [None]})
    real_get = client.real.get_object
    served = {"n": 0}

    def get_object_cut_short(**kwargs):
        """The first answer's body breaks after 1 MiB, as a reset connection would."""
        resp = real_get(**kwargs)
        served["n"] += 1
        if served["n"] == 1:
            resp["Body"] = CutShortBody(resp["Body"], MiB)
        return resp

    client.real.get_object = get_object_cut_short
    out = io.BytesIO()
    assert store.download_stream("k", out).size == len(body)
    assert out.getvalue() == body and served["n"] == 2


class CutShortBody:
    """A StreamingBody that raises a protocol error after `limit` bytes."""

    def __init__(self, body, limit: int):
        self.body, self.limit, self.sent = body, limit, 0

    def iter_chunks(self, chunk_size: int):
        import urllib3.exceptions

        for chunk in self.body.iter_chunks(chunk_size):
            if self.sent + len(chunk) > self.limit:
                self.body.close()
                raise urllib3.exceptions.ProtocolError("Connection broken: injected reset")
            self.sent += len(chunk)
            yield chunk


def test_complete_that_succeeded_unseen_leaves_a_readable_object(cfg):
    """Every answer to Complete lost: the call fails, but the object the server made
    keeps its hash record, so it is readable and verified (never unverifiable)."""
    store, client, _ = faulty_store(cfg, {"complete_multipart_upload": ["lost"] * 3}, max_attempts=3)
    body = data(11 * MiB, seed=5)
    with pytest.raises(TransientStorageError):
        store.upload_stream("big", io.BytesIO(body))
    with ObjectStore(cfg) as plain:
        assert plain.get_bytes("big") == body
    assert RawBucket(cfg).open_uploads() == []
