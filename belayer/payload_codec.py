"""Encryption of Temporal payloads: a `PayloadCodec` under the archives' key.

Every payload the SDK sends (workflow and activity inputs and results, queries, signals,
memos, and with `DefaultFailureConverterWithEncodedAttributes` the failure messages and
stack traces) goes through `EncryptionCodec.encode` before it leaves the process, so
Temporal's history stores ciphertext only. Search attributes stay plaintext: Temporal
indexes them. The data converter that installs the codec is built in one place,
`belayer.temporal_client.data_converter`; nothing else should construct one.

Key: derived with HKDF-SHA256 from `storage.encryption_key` (the checkpoint archives'
key) under its own label, so a payload key never equals an archive key. Each payload
then gets a key of its own from a random 16-byte salt, so AES-GCM nonces never repeat
however many payloads a deployment writes.

Format (one payload): metadata `encoding: binary/encrypted` and `encryption-key-id`
(a 16-hex-digit fingerprint of the payload key, not the key), data
`VERSION (1) | salt (16) | AES-256-GCM(serialized inner Payload) + 16-byte tag`. The
key id and the version are authenticated too: a payload edited, truncated, or sealed
under another key is refused with `PayloadDecryptError`, never decoded to garbage.
A payload without the marker is refused too: whoever can reach Temporal (a client
without the key, a signal sent from the CLI) could have written it, and an encrypting
deployment decodes only what its own key sealed. Histories written before encryption
was switched on are read with `temporal.accept_plaintext_payloads` (off by default),
until the workflows that hold them have ended.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

from belayer.errors import BelayerError, ConfigError
from belayer.storage.encryption import KEY_BYTES, parse_key

ENCODING = b"binary/encrypted"
KEY_ID_METADATA = "encryption-key-id"
VERSION = b"\x01"
SALT_BYTES = 16
NONCE = bytes(12)  # every payload has its own key, so one fixed nonce is safe
PAYLOAD_KEY_LABEL = b"belayer temporal payload v1"


class PayloadDecryptError(BelayerError):
    """An encrypted payload cannot be opened: tampered, truncated, or another key's."""


def derive_payload_key(master: bytes) -> bytes:
    """The payload master key: the configured key under the payload label."""

    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=PAYLOAD_KEY_LABEL).derive(master)


def key_id(payload_key: bytes) -> str:
    """A public fingerprint of the payload key: says which key sealed a payload."""
    return hashlib.sha256(b"belayer payload key id|" + payload_key).hexdigest()[:16]


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM for every payload, keyed from `storage.encryption_key`."""

    def __init__(self, master_key: bytes, *, accept_plaintext: bool = False):
        if len(master_key) != KEY_BYTES:
            raise ConfigError(f"a payload key has {KEY_BYTES} bytes, not {len(master_key)}")
        self._key = derive_payload_key(master_key)
        self.key_id = key_id(self._key)
        self.accept_plaintext = accept_plaintext

    @classmethod
    def from_setting(cls, encryption_key, *, accept_plaintext: bool = False) -> EncryptionCodec:
        """From the `storage.encryption_key` setting (a SecretStr or its text) and
        `temporal.accept_plaintext_payloads`."""
        text = (
            encryption_key.get_secret_value()
            if hasattr(encryption_key, "get_secret_value")
            else encryption_key
        )
        return cls(parse_key(text), accept_plaintext=accept_plaintext)

    def __repr__(self) -> str:
        return f"EncryptionCodec(key_id={self.key_id})"

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]

    def _aead(self, salt: bytes):
        return AESGCM(
            HKDF(
                algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=PAYLOAD_KEY_LABEL + b" object"
            ).derive(self._key)
        )

    def _aad(self, kid: str) -> bytes:
        return ENCODING + b"|" + kid.encode() + b"|" + VERSION

    def encrypt(self, payload: Payload) -> Payload:
        salt = os.urandom(SALT_BYTES)
        sealed = self._aead(salt).encrypt(NONCE, payload.SerializeToString(), self._aad(self.key_id))
        return Payload(
            metadata={"encoding": ENCODING, KEY_ID_METADATA: self.key_id.encode()},
            data=VERSION + salt + sealed,
        )

    def decrypt(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return self._unmarked(payload)
        kid = payload.metadata.get(KEY_ID_METADATA, b"").decode(errors="replace")
        if kid != self.key_id:
            raise PayloadDecryptError(
                f"payload was encrypted under key id {kid or '(none)'}, but this storage.encryption_key "
                f"has key id {self.key_id}; decode it with the key that wrote it"
            )
        data = payload.data
        if len(data) < 1 + SALT_BYTES + 16 or data[:1] != VERSION:
            raise PayloadDecryptError("encrypted payload is truncated or of an unknown version")

        try:
            plain = self._aead(data[1 : 1 + SALT_BYTES]).decrypt(
                NONCE, data[1 + SALT_BYTES :], self._aad(kid)
            )
        except InvalidTag:
            raise PayloadDecryptError(
                f"encrypted payload (key id {kid}) fails authentication: it was altered after "
                "encryption, or its key id was forged"
            ) from None
        return Payload.FromString(plain)

    def _unmarked(self, payload: Payload) -> Payload:
        """A payload this codec did not seal: refused, unless old histories are being read."""
        if self.accept_plaintext:
            return payload
        encoding = payload.metadata.get("encoding", b"").decode(errors="replace") or "(none)"
        raise PayloadDecryptError(
            f"payload is not encrypted (encoding {encoding!r}, not {ENCODING.decode()!r}) but payload "
            "encryption is on: it was not written by a Belayer process holding storage.encryption_key "
            "(a client without the codec, or a history from before encryption was switched on). If "
            "it is an old history, set BELAYER_TEMPORAL__ACCEPT_PLAINTEXT_PAYLOADS=true (or "
            "`temporal.accept_plaintext_payloads`) until its workflows have ended"
        )
