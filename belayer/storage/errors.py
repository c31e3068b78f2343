"""Storage errors, and the one translator from botocore/urllib3 errors to them.

Callers see five kinds: not found, conflict (a create-if-absent write lost), transient
(worth retrying), permanent (fix something first; auth and configuration name the
setting), corrupt (the bytes do not match their recorded sha256). Nothing outside
`belayer.storage` should catch a botocore exception. No retry logic lives here.
"""

from __future__ import annotations

import http.client
import socket

from botocore import exceptions as bc
from urllib3 import exceptions as u3

from belayer.errors import BelayerError

ENV = "BELAYER_STORAGE__"


class StorageError(BelayerError):
    """Root of every error of the storage layer.

    `code` is the S3 error code when the endpoint sent one (e.g. "NoSuchUpload").
    """

    retryable = False

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        self.code = code


class ObjectNotFound(StorageError):
    """The key does not exist (or has already been deleted)."""


class ObjectConflict(StorageError):
    """A create-if-absent write found a different object already at the key."""


class TransientStorageError(StorageError):
    """The endpoint was unreachable, slow or failing; the same call may succeed later."""

    retryable = True


class PermanentStorageError(StorageError):
    """Retrying will not help: credentials, bucket, endpoint or request are wrong."""


class CorruptObject(PermanentStorageError):
    """An object's bytes do not match its recorded sha256 or size (or it has none)."""


# Error codes S3-compatible servers send for "try again later".
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestLimitExceeded",
    "OperationAborted",
    "ConditionalRequestConflict",  # AWS: another conditional write to the key in flight
    "XAmzContentSHA256Mismatch",  # body damaged on the wire
    "BadDigest",
    "IncompleteBody",
}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_CONFLICT_CODES = {"PreconditionFailed", "412"}

# Exceptions raised by the HTTP layer (connect, send, read the body).
_TRANSIENT_TRANSPORT = (
    bc.EndpointConnectionError,
    bc.ConnectTimeoutError,
    bc.ReadTimeoutError,
    bc.ConnectionClosedError,
    bc.ResponseStreamingError,
    bc.IncompleteReadError,
    bc.HTTPClientError,
    bc.ProxyConnectionError,
    u3.ProtocolError,
    u3.ReadTimeoutError,
    u3.ConnectTimeoutError,
    u3.NewConnectionError,
    http.client.IncompleteRead,
    ConnectionError,  # builtin: refused, reset, aborted, broken pipe
    socket.timeout,
    TimeoutError,
)


def translate_error(
    exc: BaseException, *, operation: str, key: str | None, endpoint: str | None, bucket: str
) -> StorageError:
    """The Belayer storage error for a botocore/urllib3 exception raised by one S3 call.

    `operation` and `key` only make the message useful; the kind depends on `exc`.
    """
    if isinstance(exc, StorageError):
        return exc
    where = f"{operation} {key!r}" if key is not None else operation
    if isinstance(exc, bc.ClientError):
        return _translate_client_error(exc, where=where, endpoint=endpoint, bucket=bucket)
    if isinstance(exc, (bc.NoCredentialsError, bc.PartialCredentialsError)):
        return PermanentStorageError(
            f"{where}: no S3 credentials; set {ENV}ACCESS_KEY and {ENV}SECRET_KEY "
            "(or storage.access_key / storage.secret_key in the config file)"
        )
    if isinstance(exc, (bc.SSLError,)):
        return PermanentStorageError(
            f"{where}: TLS handshake with {endpoint} failed ({exc}); check {ENV}ENDPOINT "
            "(http:// vs https://) and the server's certificate"
        )
    if isinstance(exc, _TRANSIENT_TRANSPORT):
        return TransientStorageError(
            f"{where}: S3 endpoint {endpoint or 'AWS default'} unreachable or failing "
            f"({type(exc).__name__}: {exc}); is the server up (`belayer status`)? "
            f"If the address is wrong, fix {ENV}ENDPOINT"
        )
    if isinstance(exc, (bc.ParamValidationError, bc.InvalidS3AddressingStyleError, ValueError)) or isinstance(
        exc, bc.BotoCoreError
    ):
        return PermanentStorageError(f"{where}: invalid request or configuration: {exc}")
    return PermanentStorageError(f"{where}: unexpected {type(exc).__name__}: {exc}")


def _translate_client_error(
    exc: bc.ClientError, *, where: str, endpoint: str | None, bucket: str
) -> StorageError:
    error_obj = _classify_client_error(exc, where=where, endpoint=endpoint, bucket=bucket)
    error_obj.code = str(exc.response.get("Error", {}).get("Code", "")) or None
    return error_obj


def _classify_client_error(
    exc: bc.ClientError, *, where: str, endpoint: str | None, bucket: str
) -> StorageError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    detail = f"{code or status}: {error.get('Message', '')}".strip()
    if code == "NoSuchBucket":
        return PermanentStorageError(
            f"{where}: bucket {bucket!r} does not exist at {endpoint}; create it "
            f"(`belayer up` does locally) or fix {ENV}BUCKET"
        )
    if code in _NOT_FOUND_CODES or (status == 404 and not code):
        return ObjectNotFound(f"{where}: no such object in bucket {bucket!r}")
    if code == "InvalidAccessKeyId":
        return PermanentStorageError(
            f"{where}: the endpoint {endpoint} does not know this access key ({detail}); "
            f"fix {ENV}ACCESS_KEY (storage.access_key)"
        )
    if code == "SignatureDoesNotMatch":
        return PermanentStorageError(
            f"{where}: request signature rejected by {endpoint} ({detail}); the secret key "
            f"does not match the access key: fix {ENV}SECRET_KEY (storage.secret_key)"
        )
    if code in {"AccessDenied", "403", "Forbidden", "InvalidToken", "ExpiredToken"} or status == 403:
        return PermanentStorageError(
            f"{where}: access denied by {endpoint} ({detail}); check {ENV}ACCESS_KEY and "
            f"{ENV}SECRET_KEY, and that they may use bucket {bucket!r} ({ENV}BUCKET)"
        )
    if code in _CONFLICT_CODES or status == 412:
        return ObjectConflict(f"{where}: an object already exists at this key ({detail})")
    if code in _TRANSIENT_CODES or status in (408, 429) or status >= 500:
        return TransientStorageError(
            f"{where}: endpoint {endpoint} says {detail} (HTTP {status}); retry later"
        )
    if code == "PermanentRedirect" or code == "AuthorizationHeaderMalformed":
        return PermanentStorageError(f"{where}: {detail}; fix {ENV}REGION or {ENV}ENDPOINT")
    return PermanentStorageError(
        f"{where}: endpoint {endpoint} refused the request ({detail}, HTTP {status})"
    )
