"""Record logs on the real S3 server: write-once records, forks that copy nothing,
missing records reported, encryption at rest through the archive wrapper."""

from __future__ import annotations

import pytest

from belayer.storage import CorruptObject, ObjectConflict, ObjectStore
from belayer.storage.encryption import archive_store
from belayer.storage.recordlog import RecordLog, RecordLogRef

from .helpers import RawBucket


@pytest.fixture
def store(storage_config):
    with ObjectStore(storage_config) as store:
        yield store


def test_records_are_written_once_and_read_in_order(store):
    log = RecordLog.create(store, "traj/steps/v0")
    for position in range(1, 13):
        log.put(position, {"step": position, "command": f"echo {position}"})
    log.put(3, {"step": 3, "command": "echo 3"})  # a retried write of the same record
    with pytest.raises(ObjectConflict):
        log.put(3, {"step": 3, "command": "rm -rf /"})
    assert [r["step"] for r in log.read(12)] == list(range(1, 13))
    assert log.read(5)[-1]["command"] == "echo 5"


def test_a_log_says_how_many_records_it_holds_and_a_gap_is_corruption(store):
    log = RecordLog.create(store, "runs/r/iterations")
    RecordLog.create(store, "runs/r/iterations-2").put(1, {"other": "log"})  # a key that starts alike
    assert log.written() == 0
    for position in range(1, 4):
        log.put(position, {"iteration": position - 1})
    assert log.written() == 3
    log.put(5, {"iteration": 4})
    with pytest.raises(CorruptObject, match=r"records \[1, 2, 3, 5\] are not 1..4"):
        log.written()
    with pytest.raises(CorruptObject, match="no record log"):
        RecordLog(store, "runs/never").written()
    assert log.exists() and not RecordLog(store, "runs/never").exists()
    assert log.get(2) == {"iteration": 1}


def test_a_fork_inherits_a_prefix_without_copying(store):
    base = RecordLog.create(store, "traj/steps/v0")
    for position in range(1, 6):
        base.put(position, {"step": position, "branch": 0})
    fork = RecordLog.fork(store, RecordLogRef(key=base.key, length=3), "traj/steps/v1")
    fork.put(4, {"step": 4, "branch": 1})
    assert [(r["step"], r["branch"]) for r in fork.read(4)] == [(1, 0), (2, 0), (3, 0), (4, 1)]
    assert [r["branch"] for r in base.read(5)] == [0] * 5  # the base keeps its own future
    assert sorted(store.list("traj/steps/v1/")) == [
        "traj/steps/v1/00000004/record",
        "traj/steps/v1/manifest.json",
    ]


def test_a_missing_record_is_corruption_not_a_shorter_log(store):
    log = RecordLog.create(store, "traj/steps/v0")
    log.put(1, {"step": 1})
    log.put(3, {"step": 3})
    with pytest.raises(CorruptObject, match="record 2 is missing"):
        log.read(3)
    with pytest.raises(CorruptObject, match="no record log"):
        RecordLog(store, "traj/nothing").read(1)


def test_records_are_encrypted_at_rest_when_archives_are(store, storage_config):
    secret = "agent-output-7f3a9c"
    encrypted = archive_store(
        store, storage_config.model_copy(update={"encryption_key": "ab" * 32}).encryption_key
    )
    log = RecordLog.create(encrypted, "traj/steps/v0")
    log.put(1, {"stdout": secret})
    log.put(1, {"stdout": secret})  # idempotent even though the ciphertexts differ
    bucket = RawBucket(storage_config)
    raw = bucket.client.get_object(
        Bucket=storage_config.bucket, Key=bucket.full(f"traj/steps/v0/{1:08d}/record")
    )
    raw = raw["Body"].read()
    assert secret.encode() not in raw
    assert log.read(1) == [{"stdout": secret}]
