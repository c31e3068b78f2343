"""Encryption at rest of checkpoint archives: a real SeaweedFS, real sandboxes.

What an attacker with write access to the bucket can do -- flip a byte, cut the archive,
copy an archive under another sandbox's key, re-encrypt under another key -- must fail
authentication before podman sees a byte; and the stored object must not carry the
plaintext (archives hold process memory).
"""

from __future__ import annotations

import base64
import io
import os

import pytest
from pydantic import SecretStr

from belayer.errors import ConfigError
from belayer.sandbox.errors import CheckpointCorrupt
from belayer.storage.encryption import CHUNK, MAGIC, EncryptedArchiveStore, archive_store, parse_key
from belayer.storage.errors import CorruptObject
from belayer.storage.store import ObjectStore

KEY = bytes(range(32))
SECRET = b"belayer-secret-in-memory-7f3a"
# The background sleeper survived the restore (each action is a new shell: no job table).
SLEEPERS = "pgrep -c -x sleep"


@pytest.fixture
def store(storage_config):
    with ObjectStore(storage_config) as inner:
        yield inner


def _plain(size: int) -> bytes:
    # Recognisable and compressible, so it would show up verbatim in an unencrypted object.
    line = SECRET + b"\n"
    return (line * (size // len(line) + 1))[:size]


def _upload(enc: EncryptedArchiveStore, key: str, data: bytes) -> None:
    enc.upload_stream(key, (data[i : i + 300_000] for i in range(0, len(data), 300_000)))


def _download(enc, key: str, expected_sha256: str | None = None) -> bytes:
    out = io.BytesIO()
    enc.download_stream(key, out, expected_sha256=expected_sha256)
    return out.getvalue()


def test_stream_round_trip_stores_no_plaintext(store):
    import hashlib

    enc = EncryptedArchiveStore(store, KEY)
    data = _plain(2 * CHUNK + 12345)  # three frames, the last one short
    _upload(enc, "sandboxes/a/1/archive", data)
    stored = store.get_bytes("sandboxes/a/1/archive")
    assert stored.startswith(MAGIC)
    assert SECRET not in stored
    assert _download(enc, "sandboxes/a/1/archive", hashlib.sha256(data).hexdigest()) == data
    # an empty stream is one empty authenticated frame, not a missing object
    _upload(enc, "sandboxes/a/2/archive", b"")
    assert _download(enc, "sandboxes/a/2/archive") == b""


def test_metadata_passes_through_and_fs_snapshots_are_encrypted(store):
    enc = EncryptedArchiveStore(store, KEY)
    enc.put_bytes("sandboxes/a/1/meta.json", b'{"step": 1}')
    assert store.get_bytes("sandboxes/a/1/meta.json") == b'{"step": 1}'
    ref = enc.put_bytes("sandboxes/a/1/fs.tar", SECRET * 10)
    assert SECRET not in store.get_bytes("sandboxes/a/1/fs.tar")
    assert enc.get_bytes("sandboxes/a/1/fs.tar", expected_sha256=ref.sha256) == SECRET * 10


@pytest.mark.parametrize("damage", ["flip", "cut-frame", "cut-inside", "append"])
def test_tampered_archive_fails_authentication(store, damage):
    enc = EncryptedArchiveStore(store, KEY)
    key = "sandboxes/a/1/archive"
    _upload(enc, key, _plain(CHUNK + 1000))
    stored = bytearray(store.get_bytes(key))
    first_frame_end = len(MAGIC) + 32 + 4 + CHUNK + 16
    if damage == "flip":
        stored[len(stored) // 2] ^= 0x01
    elif damage == "cut-frame":
        stored = stored[:first_frame_end]  # a whole, valid first frame: only the last flag tells
    elif damage == "cut-inside":
        stored = stored[: len(stored) - 7]
    else:
        stored += stored[len(MAGIC) + 32 : first_frame_end]
    store.put_bytes(key, bytes(stored))  # the store's own sha256 now matches: only GCM can tell
    with pytest.raises(CorruptObject):
        _download(enc, key)


def test_archive_moved_to_another_key_or_read_with_another_key_is_refused(store):
    enc = EncryptedArchiveStore(store, KEY)
    _upload(enc, "sandboxes/a/1/archive", _plain(5000))
    store.put_bytes("sandboxes/b/1/archive", store.get_bytes("sandboxes/a/1/archive"))
    with pytest.raises(CorruptObject, match="fails authentication"):
        _download(enc, "sandboxes/b/1/archive")
    other = EncryptedArchiveStore(store, os.urandom(32))
    with pytest.raises(CorruptObject, match="fails authentication"):
        _download(other, "sandboxes/a/1/archive")
    store.put_bytes("sandboxes/c/1/archive", _plain(5000))  # written without a key
    with pytest.raises(CorruptObject, match="not an encrypted archive"):
        _download(enc, "sandboxes/c/1/archive")


def test_key_parsing_and_the_key_is_never_shown(store):
    text = base64.b64encode(KEY).decode()
    assert parse_key(text) == KEY
    assert parse_key(KEY.hex()) == KEY
    for bad in ("", "short", base64.b64encode(b"x" * 31).decode()):
        with pytest.raises(ConfigError, match="32 bytes") as err:
            parse_key(bad)
        assert bad not in str(err.value) or not bad
    assert archive_store(store, SecretStr("")) is store
    wrapped = archive_store(store, SecretStr(text))
    assert text not in repr(wrapped) and KEY.hex() not in repr(wrapped)
    assert text not in repr(SecretStr(text))


def test_config_masks_the_key(monkeypatch, tmp_path):
    from belayer.config import load_config, masked_dump

    text = base64.b64encode(KEY).decode()
    monkeypatch.setenv("BELAYER_STORAGE__ENCRYPTION_KEY", text)
    monkeypatch.setenv("BELAYER_STATE_DIR", str(tmp_path))
    config = load_config(None)
    assert config.storage.encryption_key.get_secret_value() == text
    assert text not in str(masked_dump(config)) and text not in repr(config)


def test_encrypted_checkpoint_restores_and_a_tampered_one_is_refused(sandboxes):
    """A live process's memory goes into the archive encrypted; restore decrypts it; one
    flipped byte of ciphertext (the bucket's sha256 record rewritten to match) is refused
    before podman runs."""
    from belayer.sandbox.models import Action

    host = sandboxes.host
    inner = host.store
    host.store = EncryptedArchiveStore(inner, KEY)
    handle = sandboxes.create()
    secret = SECRET.decode()
    host.exec(
        handle, Action(trajectory="t-enc", step=1, command=f"export HELD={secret}; sleep 600 & echo started")
    )
    ref = host.checkpoint(handle)
    meta = host.load_meta(ref)
    stored = inner.get_bytes(meta.archive_key)
    assert stored.startswith(MAGIC) and SECRET not in stored
    restored, _ = host.restore(ref, handle.generation + 1)
    obs = host.exec(restored, Action(trajectory="t-enc", step=2, command="echo $HELD; " + SLEEPERS))
    assert obs.stdout.split() == [secret, "1"]
    damaged = bytearray(stored)
    damaged[len(damaged) // 2] ^= 0x01
    inner.put_bytes(meta.archive_key, bytes(damaged))
    with pytest.raises(CheckpointCorrupt):
        host.restore(ref, restored.generation + 1)
