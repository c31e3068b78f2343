"""ObjectStore against the real SeaweedFS: round trips, verification, conflicts, faults."""

from __future__ import annotations

import hashlib
import io
import logging
import random

import pytest
from pydantic import SecretStr

from belayer.storage import (
    CorruptObject,
    ObjectConflict,
    ObjectNotFound,
    ObjectStore,
    PermanentStorageError,
    TransientStorageError,
)
from belayer.storage.retry import RetryPolicy

from .helpers import CountingSleep, RawBucket

MiB = 1 << 20


@pytest.fixture
def small_parts(storage_config):
    """The test's storage with the smallest part size S3 allows, so multipart is cheap."""
    return storage_config.model_copy(update={"part_size_mb": 5})


@pytest.fixture
def store(small_parts):
    with ObjectStore(small_parts) as store:
        yield store


@pytest.fixture
def raw(small_parts):
    return RawBucket(small_parts)


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def chunks(data: bytes, size: int):
    return (data[i : i + size] for i in range(0, len(data), size))


def test_put_get_round_trip(store, raw):
    data = payload(1000)
    ref = store.put_bytes("a/one", data)
    assert (ref.key, ref.size, ref.sha256) == ("a/one", 1000, hashlib.sha256(data).hexdigest())
    assert store.get_bytes("a/one") == data
    assert store.get_bytes("a/one", expected_sha256=ref.sha256) == data
    assert store.head("a/one") == ref
    assert raw.head("a/one")["Metadata"]["sha256"] == ref.sha256


def test_empty_object_round_trip(store):
    ref = store.put_bytes("empty", b"")
    assert store.get_bytes("empty") == b""
    assert store.download_stream("empty", io.BytesIO()) == ref
    assert store.upload_stream("empty2", iter([])).size == 0


def test_missing_object(store):
    with pytest.raises(ObjectNotFound):
        store.get_bytes("nope")
    with pytest.raises(ObjectNotFound):
        store.head("nope")
    with pytest.raises(ObjectNotFound):
        store.download_stream("nope", io.BytesIO())
    assert not store.exists("nope")
    store.delete("nope")  # deleting a missing key is fine


@pytest.mark.parametrize("source_kind", ["file", "iterator"])
def test_multipart_stream_round_trip(store, raw, source_kind):
    data = payload(12 * MiB + 123, seed=1)  # 3 parts of 5 MiB
    source = io.BytesIO(data) if source_kind == "file" else chunks(data, 777_777)
    seen = []
    ref = store.upload_stream("big", source, progress=seen.append)
    assert ref.size == len(data) and ref.sha256 == hashlib.sha256(data).hexdigest()
    assert seen == sorted(seen) and seen[-1] == len(data)
    assert "sha256-record" in raw.head("big")["Metadata"]
    assert len(raw.records()) == 1
    assert store.head("big") == ref
    out = io.BytesIO()
    assert store.download_stream("big", out) == ref
    assert out.getvalue() == data
    assert store.get_bytes("big") == data
    assert b"".join(store.iter_download("big", chunk_size=MiB)) == data
    assert raw.open_uploads() == []


def test_short_stream_is_a_single_put(store, raw):
    ref = store.upload_stream("short", io.BytesIO(b"x" * 1000))
    assert raw.head("short")["Metadata"]["sha256"] == ref.sha256
    assert raw.records() == []


def test_overwriting_a_multipart_object_replaces_its_record(store, raw):
    store.upload_stream("big", chunks(payload(11 * MiB, seed=2), MiB))
    data = payload(11 * MiB, seed=3)
    ref = store.upload_stream("big", chunks(data, MiB))
    assert store.get_bytes("big") == data and store.head("big") == ref
    assert len(raw.records()) == 1


def test_server_honours_conditional_put_and_complete(raw):
    """SeaweedFS 4.48 implements If-None-Match: * on PutObject and CompleteMultipartUpload."""
    bucket, key = raw.cfg.bucket, raw.full("cond")
    raw.client.put_object(Bucket=bucket, Key=key, Body=b"first")
    with pytest.raises(Exception) as info:
        raw.client.put_object(Bucket=bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    upload = raw.client.create_multipart_upload(Bucket=bucket, Key=key)
    part = raw.client.upload_part(
        Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"p" * 5 * MiB
    )
    with pytest.raises(Exception) as info:
        raw.client.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload["UploadId"],
            MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]},
            IfNoneMatch="*",
        )
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    raw.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"])
    assert raw.client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"first"


def test_create_if_absent_put(store):
    ref = store.put_bytes("once", b"first", if_absent=True)
    assert store.put_bytes("once", b"first", if_absent=True) == ref  # a retry is idempotent
    with pytest.raises(ObjectConflict, match="different object"):
        store.put_bytes("once", b"second", if_absent=True)
    assert store.get_bytes("once") == b"first"
    store.put_bytes("once", b"second")  # without if_absent it replaces
    assert store.get_bytes("once") == b"second"


def test_metadata_is_written_with_the_object_and_part_of_its_identity(store):
    ref = store.put_bytes("marked", b"tokens", if_absent=True, metadata={"source": "model"})
    assert store.head_metadata("marked") == (ref, {"source": "model"})
    assert store.put_bytes("marked", b"tokens", if_absent=True, metadata={"source": "model"}) == ref  # retry
    with pytest.raises(ObjectConflict, match="different object"):
        store.put_bytes("marked", b"tokens", if_absent=True, metadata={"source": "env"})
    with pytest.raises(ObjectConflict, match="different object"):
        store.put_bytes("marked", b"tokens", if_absent=True)
    store.put_bytes("plain", b"x")
    assert store.head_metadata("plain")[1] == {}
    for bad in ({"sha256": "0" * 64}, {"Source": "env"}, {"source": "é"}):
        with pytest.raises(ValueError, match="metadata"):
            store.put_bytes("refused", b"x", metadata=bad)
    assert not store.exists("refused")


def test_create_if_absent_multipart(store, raw):
    data = payload(11 * MiB, seed=4)
    ref = store.upload_stream("once", chunks(data, MiB), if_absent=True)
    assert store.upload_stream("once", io.BytesIO(data), if_absent=True) == ref
    with pytest.raises(ObjectConflict):
        store.upload_stream("once", chunks(payload(11 * MiB, seed=5), MiB), if_absent=True)
    with pytest.raises(ObjectConflict):
        store.put_bytes("once", b"small", if_absent=True)
    assert store.get_bytes("once") == data
    assert raw.open_uploads() == []
    assert len(raw.records()) == 1  # the losers' records are gone


def test_corrupted_object_is_detected(store, raw):
    data = payload(4096, seed=6)
    store.put_bytes("c", data)
    damaged = bytearray(data)
    damaged[100] ^= 0xFF
    raw.overwrite("c", bytes(damaged))
    with pytest.raises(CorruptObject, match="corrupt"):
        store.get_bytes("c")
    with pytest.raises(CorruptObject, match="corrupt"):
        store.download_stream("c", io.BytesIO())


def test_truncated_object_is_detected(store, raw):
    data = payload(4096, seed=7)
    store.put_bytes("t", data)
    raw.overwrite("t", data[:1000])
    with pytest.raises(CorruptObject, match="truncated: 1000 bytes read, 4096 recorded"):
        store.get_bytes("t")
    with pytest.raises(CorruptObject, match="truncated"):
        store.download_stream("t", io.BytesIO())


def test_corrupted_multipart_object_is_detected(store, raw):
    data = payload(11 * MiB, seed=8)
    store.upload_stream("m", chunks(data, MiB))
    raw.overwrite("m", data[: 6 * MiB])  # keeps the pointer to the hash record
    with pytest.raises(CorruptObject, match="truncated"):
        store.download_stream("m", io.BytesIO())
    raw.overwrite("m", data[:-1] + b"\0")
    with pytest.raises(CorruptObject, match="corrupt"):
        b"".join(store.iter_download("m"))


def test_unrecorded_or_unexpected_objects_are_refused(store, raw):
    raw.client.put_object(Bucket=raw.cfg.bucket, Key=raw.full("foreign"), Body=b"abc")
    with pytest.raises(CorruptObject, match="no recorded sha256"):
        store.get_bytes("foreign")
    sha = hashlib.sha256(b"abc").hexdigest()
    assert store.get_bytes("foreign", expected_sha256=sha) == b"abc"
    ref = store.put_bytes("mine", b"abc")
    with pytest.raises(CorruptObject, match="not the expected"):
        store.get_bytes("mine", expected_sha256=hashlib.sha256(b"other").hexdigest())
    assert ref.sha256 == sha


def test_missing_hash_record_is_detected(store, raw):
    store.upload_stream("m", chunks(payload(11 * MiB, seed=9), MiB))
    for record in raw.records():
        raw.client.delete_object(Bucket=raw.cfg.bucket, Key=raw.full(record))
    with pytest.raises(CorruptObject, match="hash record .* is missing"):
        store.get_bytes("m")


def test_list_and_delete_by_prefix(store, raw):
    for key in ["run/1/a", "run/1/b", "run/2/a", "other/x"]:
        store.put_bytes(key, key.encode())
    store.upload_stream("run/1/big", chunks(payload(11 * MiB, seed=10), MiB))
    assert list(store.list("run/1/")) == ["run/1/a", "run/1/b", "run/1/big"]
    assert list(store.list("")) == ["other/x", "run/1/a", "run/1/b", "run/1/big", "run/2/a"]
    assert store.delete_prefix("run/1/") == 3
    assert list(store.list("")) == ["other/x", "run/2/a"]
    assert raw.records() == []
    store.delete("run/2/a")
    assert not store.exists("run/2/a") and store.exists("other/x")
    assert store.delete_prefix("nothing/") == 0


def test_list_pages_through_many_keys(small_parts):
    cfg = small_parts
    with ObjectStore(cfg) as store:
        keys = [f"many/{i:04d}" for i in range(1100)]
        for key in keys:
            store.put_bytes(key, b"")
        assert list(store.list("many/")) == keys
        assert store.delete_prefix("many/") == 1100
        assert list(store.list("many/")) == []


def test_reserved_keys_are_refused(store):
    with pytest.raises(ValueError):
        store.put_bytes(".belayer-records/x", b"")
    with pytest.raises(ValueError):
        store.put_bytes("", b"")


def test_failing_source_aborts_the_upload(store, raw):
    def source():
        yield payload(6 * MiB)
        yield payload(6 * MiB)
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        store.upload_stream("broken", source())
    assert raw.open_uploads() == []
    assert raw.records() == []
    assert not store.exists("broken")


@pytest.mark.parametrize(
    ("setting", "field", "value"),
    [
        ("BELAYER_STORAGE__ACCESS_KEY", "access_key", SecretStr("nobody")),
        ("BELAYER_STORAGE__SECRET_KEY", "secret_key", SecretStr("wrong-secret")),
        ("BELAYER_STORAGE__BUCKET", "bucket", "no-such-bucket"),
    ],
)
def test_wrong_settings_give_a_permanent_error_naming_the_setting(storage_config, setting, field, value):
    sleep = CountingSleep()
    cfg = storage_config.model_copy(update={field: value})
    with ObjectStore(cfg, retry=RetryPolicy(max_attempts=5, sleep=sleep)) as store:
        with pytest.raises(PermanentStorageError, match=setting):
            store.check()
        with pytest.raises(PermanentStorageError, match=setting):
            store.put_bytes("k", b"data")
        with pytest.raises(PermanentStorageError, match=setting):
            store.get_bytes("k")
        with pytest.raises(PermanentStorageError, match=setting):
            store.upload_stream("k", chunks(payload(11 * MiB), MiB))
    assert sleep.delays == []  # never retried


def test_unreachable_endpoint_is_transient_and_names_the_endpoint(storage_config):
    cfg = storage_config.model_copy(update={"endpoint": "http://127.0.0.1:9", "max_attempts": 2})
    sleep = CountingSleep()
    with ObjectStore(cfg, retry=RetryPolicy(max_attempts=2, sleep=sleep)) as store:
        with pytest.raises(TransientStorageError, match="BELAYER_STORAGE__ENDPOINT"):
            store.put_bytes("k", b"data")
    assert len(sleep.delays) == 1


def test_server_killed_during_upload_then_retry_succeeds(seaweedfs, small_parts, raw):
    data = payload(20 * MiB, seed=11)
    cfg = small_parts.model_copy(update={"max_attempts": 3, "retry_base_delay_s": 0.05})

    def source_that_kills_the_server():
        for i, chunk in enumerate(chunks(data, MiB)):
            if i == 12:  # parts 1-2 are read before the upload is created
                seaweedfs.kill()
            yield chunk

    try:
        with ObjectStore(cfg) as store:
            with pytest.raises(TransientStorageError) as info:
                store.upload_stream("ckpt", source_that_kills_the_server(), if_absent=True)
            assert "could not be aborted" in " ".join(getattr(info.value, "__notes__", []))
    finally:
        seaweedfs.start()
    # SeaweedFS may answer InternalError for a few seconds after it is back (seen: 4.5 s);
    # the retry policy's patience rides that out (12 attempts wait at least 18 s).
    patient = small_parts.model_copy(update={"max_attempts": 12})
    with ObjectStore(patient) as store:
        ref = store.upload_stream("ckpt", chunks(data, MiB), if_absent=True)
        assert ref.sha256 == hashlib.sha256(data).hexdigest()
        out = io.BytesIO()
        assert store.download_stream("ckpt", out) == ref and out.getvalue() == data
        assert store.abort_incomplete_uploads("", older_than_s=3600) == 0  # too young to be touched
        store.abort_incomplete_uploads("")
    assert raw.open_uploads() == []


def test_data_survives_a_server_crash(seaweedfs, store):
    ref = store.put_bytes("durable", b"still here")
    seaweedfs.kill()
    try:
        with pytest.raises(TransientStorageError):
            ObjectStore(store.cfg, retry=RetryPolicy(max_attempts=1)).get_bytes("durable")
    finally:
        seaweedfs.start()
    with ObjectStore(store.cfg.model_copy(update={"max_attempts": 12})) as patient:  # see the test above
        assert patient.get_bytes("durable", expected_sha256=ref.sha256) == b"still here"


def test_download_resumes_after_the_server_restarts_mid_stream(seaweedfs, small_parts, caplog):
    data = payload(40 * MiB, seed=12)
    patient = small_parts.model_copy(update={"max_attempts": 12})  # see the test above
    with ObjectStore(patient) as store:
        ref = store.upload_stream("resume", chunks(data, MiB))
        stream = store.iter_download("resume", chunk_size=64 * 1024)
        received = [next(stream)]
        seaweedfs.kill()
        seaweedfs.start()
        with caplog.at_level(logging.INFO, logger="belayer.storage.store"):
            received += list(stream)  # the broken response is resumed with a ranged GET
        assert b"".join(received) == data
        assert store.head("resume") == ref
    assert any("resuming at byte" in r.getMessage() for r in caplog.records)
