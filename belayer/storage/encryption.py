"""Encryption at rest for checkpoint archives (they hold process memory), and
authentication of the checkpoint metadata that says how to restore them.

`EncryptedArchiveStore` wraps the slice of `ObjectStore` that sandbox checkpoints use
(belayer/sandbox/host.py `ArchiveStore`) and encrypts, client-side, every object that
carries sandbox data: archive streams and `fs.tar` snapshots. Checkpoint metadata
(`meta.json`: steps, hashes, versions, the lineage, its netns and channel) and a
drain's record of the checkpoint it took stay readable, so tools can list checkpoints
without the key, but they carry a MAC: HMAC-SHA256 under a key derived from the
configured one (label `belayer checkpoint metadata mac v1`), over the object key and the
bytes, in the object's own metadata (`x-amz-meta-belayer-mac`, written and read in the
same request as the bytes). One edited, copied from another key, or written without the
key is refused (`CorruptObject`) before anything parses it. With the archive's AES-GCM
(below) and the archive sha256 the workflow pins (`CheckpointRef`), nothing a restore
uses comes from the bucket unauthenticated.

Format (one object): `MAGIC (8) | salt (32)` then frames `length (4, big-endian) |
AES-256-GCM(ciphertext + 16-byte tag)` of at most `CHUNK` plaintext bytes each. The
object's own key is derived with HKDF-SHA256 from the configured key and the random
salt, so nonces (a frame counter) never repeat under one key. Each frame's nonce is
`counter (11 bytes) | last flag (1 byte)` and its associated data is the header plus
the object key: a frame moved, dropped, reordered, truncated at a frame boundary, or an
archive copied under another key fails authentication (`CorruptObject`), as does any
flipped byte. The ObjectStore's own sha256 still covers the stored ciphertext, and the
sandbox host still checks the plaintext sha256 it recorded before podman sees it.

The key never appears in logs, errors or `repr`: it is held as bytes in a closure-free
AESGCM object and the configuration keeps it in a `SecretStr`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from belayer.errors import ConfigError
from belayer.storage.errors import CorruptObject

MAGIC = b"BLYRAE01"
SALT_BYTES = 32
CHUNK = 1 << 20
TAG_BYTES = 16
_LEN = struct.Struct(">I")
KEY_BYTES = 32
# Names (last key component) of what holds agent data: checkpoint archives and file-system
# snapshots, observations and the step records of the trajectory log.
ENCRYPTED_SUFFIXES = ("archive", "fs.tar", "observation", "record")
MAC_METADATA = "belayer-mac"
MAC_LABEL = b"belayer checkpoint metadata mac v1"


def parse_key(text: str) -> bytes:
    """A 32-byte key from its base64 (or 64-hex-digit) form; a clear error otherwise."""
    text = text.strip()
    raw: bytes | None = None
    if len(text) == 2 * KEY_BYTES:
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = None
    if raw is None:
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raw = None
    if raw is None or len(raw) != KEY_BYTES:
        raise ConfigError(
            "storage.encryption_key must be 32 bytes, base64 or hex encoded (make one with "
            "`python3 -c 'import os, base64; print(base64.b64encode(os.urandom(32)).decode())'`); "
            "fix BELAYER_STORAGE__ENCRYPTION_KEY or `storage.encryption_key` in the config file"
        )
    return raw


class ArchiveCipher:
    """AES-256-GCM in authenticated frames under a per-object derived key."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ConfigError(f"an archive key has {KEY_BYTES} bytes, not {len(key)}")
        self._key = key

    def __repr__(self) -> str:
        return "ArchiveCipher(key=**********)"

    def _aead(self, salt: bytes):
        derived = HKDF(
            algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=b"belayer checkpoint archive v1"
        ).derive(self._key)
        return AESGCM(derived)

    def encrypt(self, object_key: str, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The encrypted object, frame by frame, from plaintext chunks of any size."""
        salt = os.urandom(SALT_BYTES)
        header = MAGIC + salt
        aead = self._aead(salt)
        aad = header + object_key.encode()
        yield header
        counter = 0
        pending = bytearray()
        source = iter(chunks)
        exhausted = False
        while True:
            while len(pending) <= CHUNK and not exhausted:
                try:
                    pending += next(source)
                except StopIteration:
                    exhausted = True
            last = exhausted and len(pending) <= CHUNK
            piece = bytes(pending[:CHUNK])
            del pending[:CHUNK]
            sealed = aead.encrypt(_nonce(counter, last), piece, aad)
            yield _LEN.pack(len(sealed)) + sealed
            counter += 1
            if last:
                return

    def decryptor(self, object_key: str) -> _Decryptor:
        return _Decryptor(self, object_key)


class _Decryptor:
    """Feed ciphertext in any pieces; get plaintext back frame by frame; `finish()` checks
    that the last frame came and nothing followed it."""

    def __init__(self, cipher: ArchiveCipher, object_key: str):
        self.cipher = cipher
        self.object_key = object_key
        self.buffer = bytearray()
        self.aead: Any = None
        self.aad = b""
        self.counter = 0
        self.done = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        self.buffer += data
        if self.aead is None:
            if len(self.buffer) < len(MAGIC) + SALT_BYTES:
                return
            header = bytes(self.buffer[: len(MAGIC) + SALT_BYTES])
            if header[: len(MAGIC)] != MAGIC:
                raise CorruptObject(
                    f"{self.object_key!r} is not an encrypted archive (no {MAGIC.decode()} "
                    "header): written without storage.encryption_key, or damaged"
                )
            self.aead = self.cipher._aead(header[len(MAGIC) :])
            self.aad = header + self.object_key.encode()
            del self.buffer[: len(header)]
        while len(self.buffer) >= _LEN.size:
            (length,) = _LEN.unpack_from(self.buffer)
            if length < TAG_BYTES or length > CHUNK + TAG_BYTES:
                raise CorruptObject(
                    f"{self.object_key!r}: encrypted frame {self.counter} has an impossible length"
                )
            if len(self.buffer) < _LEN.size + length:
                return
            if self.done:
                raise CorruptObject(f"{self.object_key!r}: data after the last encrypted frame")
            sealed = bytes(self.buffer[_LEN.size : _LEN.size + length])
            del self.buffer[: _LEN.size + length]
            yield self._open(sealed)

    def _open(self, sealed: bytes) -> bytes:
        for last in (False, True):
            try:
                plain = self.aead.decrypt(_nonce(self.counter, last), sealed, self.aad)
            except InvalidTag:
                continue
            self.counter += 1
            self.done = last
            return plain
        raise CorruptObject(
            f"{self.object_key!r}: encrypted frame {self.counter} fails authentication (tampered, "
            "moved from another key, or encrypted under another storage.encryption_key)"
        )

    def finish(self) -> None:
        if self.aead is None or not self.done or self.buffer:
            raise CorruptObject(f"{self.object_key!r}: encrypted archive is truncated")


def _nonce(counter: int, last: bool) -> bytes:
    return counter.to_bytes(11, "big") + (b"\x01" if last else b"\x00")


class MetadataMac:
    """HMAC-SHA256 of a readable control-plane object, bound to its object key."""

    def __init__(self, key: bytes):
        self._key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=MAC_LABEL).derive(key)

    def __repr__(self) -> str:
        return "MetadataMac(key=**********)"

    @staticmethod
    def applies_to(key: str) -> bool:
        """meta.json, and a drain's record (`<lineage>/drained/g<N>.json`): what names the
        checkpoint a restore starts from."""
        parts = key.rsplit("/", 2)
        return parts[-1] == "meta.json" or (
            len(parts) == 3 and parts[1] == "drained" and parts[2].endswith(".json")
        )

    def tag(self, key: str, data: bytes) -> str:
        return hmac.new(self._key, key.encode() + b"\0" + data, hashlib.sha256).hexdigest()

    def check(self, key: str, data: bytes, metadata: dict[str, str]) -> None:
        got = metadata.get(MAC_METADATA)
        if got is None:
            raise CorruptObject(
                f"{key!r} carries no MAC: it was written without storage.encryption_key "
                "(or not by Belayer); refused"
            )
        if not hmac.compare_digest(got, self.tag(key, data)):
            raise CorruptObject(
                f"{key!r} fails authentication (MAC): edited, copied from another key, or "
                "written under another storage.encryption_key; refused"
            )


class EncryptedArchiveStore:
    """An `ArchiveStore` that encrypts sandbox data at rest and passes the rest through.

    `upload_stream` / `download_stream` keep the plaintext contract of the host: the
    `expected_sha256` of a download is the plaintext's (what the host recorded while
    streaming the dump), checked after every frame authenticated.
    """

    def __init__(self, inner: Any, key: bytes):
        self.inner = inner
        self.cipher = ArchiveCipher(key)
        self.mac = MetadataMac(key)

    def __repr__(self) -> str:
        return f"EncryptedArchiveStore({self.inner!r}, key=**********)"

    def __getattr__(self, name: str) -> Any:  # list, exists, close...: the inner store's
        return getattr(self.inner, name)

    @staticmethod
    def encrypts(key: str) -> bool:
        return key.rsplit("/", 1)[-1] in ENCRYPTED_SUFFIXES

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False, metadata=None):
        """Metadata is stored as given, in the clear (token-log marks, never secrets)."""
        if self.mac.applies_to(key):
            data = bytes(data)
            metadata = {**(metadata or {}), MAC_METADATA: self.mac.tag(key, data)}
            return self.inner.put_bytes(key, data, if_absent=if_absent, metadata=metadata)
        if not self.encrypts(key):
            return self.inner.put_bytes(key, data, if_absent=if_absent, metadata=metadata)
        return self.inner.put_bytes(
            key, b"".join(self.cipher.encrypt(key, [bytes(data)])), if_absent=if_absent, metadata=metadata
        )

    def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes:
        if self.mac.applies_to(key):
            data, metadata = self.inner.get_bytes_and_metadata(key, expected_sha256=expected_sha256)
            self.mac.check(key, data, metadata)
            return data
        stored = self.inner.get_bytes(key, expected_sha256=expected_sha256)
        if not self.encrypts(key):
            return stored
        decryptor = self.cipher.decryptor(key)
        plain = b"".join(decryptor.feed(stored))
        decryptor.finish()
        return plain

    def upload_stream(
        self, key: str, source: BinaryIO | Iterable[bytes], *, if_absent: bool = False, progress=None
    ):
        if not self.encrypts(key):
            return self.inner.upload_stream(key, source, if_absent=if_absent, progress=progress)
        chunks = source if not hasattr(source, "read") else iter(lambda: source.read(CHUNK), b"")
        return self.inner.upload_stream(
            key, self.cipher.encrypt(key, chunks), if_absent=if_absent, progress=progress
        )

    def download_stream(self, key: str, dest: BinaryIO, *, expected_sha256: str | None = None, progress=None):
        if not self.encrypts(key):
            return self.inner.download_stream(key, dest, expected_sha256=expected_sha256, progress=progress)
        decryptor = self.cipher.decryptor(key)
        plain_sha = hashlib.sha256()

        class _Sink:
            def write(self, data: bytes) -> int:
                for plain in decryptor.feed(data):
                    plain_sha.update(plain)
                    dest.write(plain)
                return len(data)

        ref = self.inner.download_stream(key, _Sink(), progress=progress)
        decryptor.finish()
        if expected_sha256 is not None and plain_sha.hexdigest() != expected_sha256:
            raise CorruptObject(
                f"{key!r}: decrypted sha256 {plain_sha.hexdigest()} is not the expected {expected_sha256}"
            )
        return ref

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)


def archive_store(inner: Any, encryption_key) -> Any:
    """`inner`, wrapped for encryption when a key is configured (a SecretStr or None)."""
    if encryption_key is None:
        return inner
    secret = (
        encryption_key.get_secret_value() if hasattr(encryption_key, "get_secret_value") else encryption_key
    )
    if not secret:
        return inner
    return EncryptedArchiveStore(inner, parse_key(secret))
