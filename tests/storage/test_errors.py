"""The boto3 error translator and the retry policy, with small fakes (no server)."""

from __future__ import annotations

import random

import pytest
import urllib3.exceptions
from botocore import exceptions as bc

from belayer.errors import BelayerError
from belayer.storage.errors import (
    CorruptObject,
    ObjectConflict,
    ObjectNotFound,
    PermanentStorageError,
    StorageError,
    TransientStorageError,
    translate_error,
)
from belayer.storage.retry import RetryPolicy

from .helpers import CountingSleep


def client_error(code: str, status: int, message: str = "") -> bc.ClientError:
    return bc.ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


def translate(exc: BaseException) -> StorageError:
    return translate_error(exc, operation="put", key="k", endpoint="http://127.0.0.1:1", bucket="b")


def test_hierarchy_roots_at_belayer_error():
    for cls in (ObjectNotFound, ObjectConflict, TransientStorageError, PermanentStorageError, CorruptObject):
        assert issubclass(cls, StorageError) and issubclass(cls, BelayerError)
    assert issubclass(CorruptObject, PermanentStorageError)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("NoSuchKey", 404, ObjectNotFound),
        ("404", 404, ObjectNotFound),
        ("PreconditionFailed", 412, ObjectConflict),
        ("SlowDown", 503, TransientStorageError),
        ("InternalError", 500, TransientStorageError),
        ("ServiceUnavailable", 503, TransientStorageError),
        ("", 502, TransientStorageError),
        ("TooManyRequests", 429, TransientStorageError),
        ("ConditionalRequestConflict", 409, TransientStorageError),
        ("NoSuchBucket", 404, PermanentStorageError),
        ("InvalidAccessKeyId", 403, PermanentStorageError),
        ("SignatureDoesNotMatch", 403, PermanentStorageError),
        ("AccessDenied", 403, PermanentStorageError),
        ("InvalidArgument", 400, PermanentStorageError),
        ("NoSuchUpload", 404, PermanentStorageError),
    ],
)
def test_client_errors_map_to_kinds(code, status, kind):
    error = translate(client_error(code, status))
    assert type(error) is kind
    assert error.code == (code or None)


@pytest.mark.parametrize(
    ("code", "setting"),
    [
        ("InvalidAccessKeyId", "BELAYER_STORAGE__ACCESS_KEY"),
        ("SignatureDoesNotMatch", "BELAYER_STORAGE__SECRET_KEY"),
        ("NoSuchBucket", "BELAYER_STORAGE__BUCKET"),
        ("403", "BELAYER_STORAGE__ACCESS_KEY"),
    ],
)
def test_configuration_errors_name_the_setting(code, setting):
    assert setting in str(translate(client_error(code, 403 if code != "NoSuchBucket" else 404)))


@pytest.mark.parametrize(
    "exc",
    [
        bc.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        bc.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"),
        bc.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
        bc.ConnectionClosedError(endpoint_url="http://127.0.0.1:1"),
        bc.ResponseStreamingError(error="reset"),
        bc.IncompleteReadError(actual_bytes=1, expected_bytes=2),
        urllib3.exceptions.ProtocolError("Connection broken"),
        ConnectionResetError(104, "reset"),
        ConnectionRefusedError(111, "refused"),
        TimeoutError("timed out"),
    ],
)
def test_transport_failures_are_transient(exc):
    error = translate(exc)
    assert isinstance(error, TransientStorageError)
    assert "BELAYER_STORAGE__ENDPOINT" in str(error)


def test_missing_credentials_are_permanent_and_named():
    error = translate(bc.NoCredentialsError())
    assert isinstance(error, PermanentStorageError)
    assert "BELAYER_STORAGE__ACCESS_KEY" in str(error)


def test_storage_errors_pass_through_unchanged():
    original = CorruptObject("bad")
    assert translate(original) is original


class Flaky:
    """Fails with the given exceptions in turn, then returns 'ok'."""

    def __init__(self, *failures: BaseException):
        self.failures = list(failures)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def policy(max_attempts: int) -> tuple[RetryPolicy, CountingSleep]:
    sleep = CountingSleep()
    return RetryPolicy(
        max_attempts=max_attempts, base_delay_s=0.1, max_delay_s=1.0, sleep=sleep, rng=random.Random(0)
    ), sleep


def test_transient_errors_are_retried_with_growing_bounded_backoff():
    retry, sleep = policy(5)
    fn = Flaky(client_error("SlowDown", 503), ConnectionResetError(), client_error("", 500))
    assert retry.call(fn, translate=translate, what="put k") == "ok"
    assert fn.calls == 4
    assert len(sleep.delays) == 3
    for attempt, delay in enumerate(sleep.delays, start=1):
        cap = min(1.0, 0.1 * 2 ** (attempt - 1))
        assert cap / 2 <= delay <= cap


def test_transient_errors_give_up_after_max_attempts():
    retry, sleep = policy(3)
    fn = Flaky(*[ConnectionRefusedError()] * 5)
    with pytest.raises(TransientStorageError, match="after 3 attempts"):
        retry.call(fn, translate=translate, what="put k")
    assert fn.calls == 3 and len(sleep.delays) == 2


@pytest.mark.parametrize(
    "exc",
    [
        client_error("InvalidAccessKeyId", 403),
        client_error("NoSuchKey", 404),
        client_error("PreconditionFailed", 412),
    ],
)
def test_permanent_errors_are_never_retried(exc):
    retry, sleep = policy(5)
    fn = Flaky(exc)
    with pytest.raises(StorageError) as info:
        retry.call(fn, translate=translate, what="put k")
    assert not isinstance(info.value, TransientStorageError)
    assert fn.calls == 1 and sleep.delays == []
    assert info.value.__cause__ is exc


def test_delays_are_capped():
    retry = RetryPolicy(max_attempts=20, base_delay_s=1.0, max_delay_s=3.0, rng=random.Random(1))
    assert all(retry.delay(attempt) <= 3.0 for attempt in range(1, 20))


def test_storage_errors_raised_inside_are_not_retried_again():
    retry, sleep = policy(5)
    fn = Flaky(TransientStorageError("already retried below"))
    with pytest.raises(TransientStorageError, match="already retried below"):
        retry.call(fn, translate=translate, what="get k")
    assert fn.calls == 1 and sleep.delays == []
