"""Sandbox config bounds and the local-directory archive store (no podman needed)."""

from __future__ import annotations

import io

import pytest
from pydantic import ValidationError

from belayer.sandbox.config import SandboxConfig
from belayer.sandbox.localstore import LocalDirStore
from belayer.sandbox.models import Observation, observation_hash
from belayer.storage.errors import CorruptObject, ObjectNotFound


def test_tmpfs_must_fit_in_memory():
    SandboxConfig()  # the defaults are consistent
    with pytest.raises(ValidationError, match="raise sandbox.memory_mb"):
        SandboxConfig(memory_mb=256)
    with pytest.raises(ValidationError):
        SandboxConfig(output_cap_bytes=1 << 20)  # would not fit a Temporal payload


def test_local_store_verifies(tmp_path):
    store = LocalDirStore(tmp_path)
    ref = store.upload_stream("a/b/archive", iter([b"x" * 10, b"y" * 5]))
    assert ref.size == 15
    buf = io.BytesIO()
    store.download_stream("a/b/archive", buf, expected_sha256=ref.sha256)
    assert buf.getvalue() == b"x" * 10 + b"y" * 5
    (tmp_path / "a/b/archive").write_bytes(b"tampered")
    with pytest.raises(CorruptObject):
        store.download_stream("a/b/archive", io.BytesIO())
    with pytest.raises(ObjectNotFound):
        store.get_bytes("a/missing")
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"")
    assert store.delete_prefix("a/") == 1 and not (tmp_path / "a").exists()


def test_observation_hash_ignores_timings():
    import base64

    raw = {"exit_code": 0, "timed_out": False, "duration_s": 1.0, "shell_respawned": False, "note": "",
           "stdout": {"b64": base64.b64encode(b"\xffok").decode(), "total": 3, "dropped": 0},
           "stderr": {"b64": "", "total": 0, "dropped": 0}}  # fmt: skip
    a = Observation.from_supervisor(raw, replayed=False)
    b = Observation.from_supervisor(dict(raw, duration_s=9.0), replayed=True)
    assert a.sha256 == b.sha256 == observation_hash(0, b"\xffok", b"", False)
    assert a.binary and a.stdout == "\\xffok"
