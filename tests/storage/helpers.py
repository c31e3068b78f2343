"""Helpers for the storage tests: raw access to the bucket, behind Belayer's back."""

from __future__ import annotations

from botocore import exceptions as bc

from belayer.storage.config import StorageConfig
from belayer.storage.s3client import make_s3_client
from belayer.storage.store import RECORD_ROOT


class RawBucket:
    """A plain boto3 client on the test's key prefix, to damage objects and inspect leftovers."""

    def __init__(self, cfg: StorageConfig):
        self.cfg = cfg
        self.client = make_s3_client(cfg)

    def full(self, key: str) -> str:
        return self.cfg.key_prefix + key

    def head(self, key: str) -> dict:
        return self.client.head_object(Bucket=self.cfg.bucket, Key=self.full(key))

    def overwrite(self, key: str, data: bytes, *, keep_metadata: bool = True) -> None:
        """Replace the object's bytes; keeping its metadata keeps its recorded sha256 too."""
        metadata = self.head(key)["Metadata"] if keep_metadata else {}
        self.client.put_object(Bucket=self.cfg.bucket, Key=self.full(key), Body=data, Metadata=metadata)

    def all_keys(self) -> list[str]:
        """Every key under the test's prefix, hash records included, relative to it."""
        keys = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.cfg.bucket, Prefix=self.cfg.key_prefix):
            keys += [obj["Key"][len(self.cfg.key_prefix) :] for obj in page.get("Contents", [])]
        return keys

    def records(self) -> list[str]:
        return [k for k in self.all_keys() if k.startswith(RECORD_ROOT)]

    def open_uploads(self) -> list[dict]:
        return self.client.list_multipart_uploads(Bucket=self.cfg.bucket, Prefix=self.cfg.key_prefix).get(
            "Uploads", []
        )


class CountingSleep:
    """Stands in for time.sleep in RetryPolicy: records the delays instead of sleeping."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class FaultyClient:
    """A real boto3 client with faults injected into named calls, one per call, in order.

    `plan` maps a method name to a list of faults: "refused" (raise before the request
    is sent), "lost" (the request is served, then the answer is lost), "slowdown" (an
    HTTP 503 SlowDown instead of the request), or None (no fault for that call).
    """

    def __init__(self, real, plan: dict[str, list[str | None]]):
        self.real = real
        self.plan = plan
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        method = getattr(self.real, name)
        if name not in self.plan:
            return method

        def faulty(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            fault = self.plan[name].pop(0) if self.plan[name] else None
            if fault == "refused":
                raise bc.EndpointConnectionError(endpoint_url="http://injected-fault")
            if fault == "slowdown":
                raise bc.ClientError(
                    {
                        "Error": {"Code": "SlowDown", "Message": "injected"},
                        "ResponseMetadata": {"HTTPStatusCode": 503},
                    },
                    name,
                )
            result = method(*args, **kwargs)
            if fault == "lost":
                raise bc.ConnectionClosedError(endpoint_url="http://injected-fault")
            return result

        return faulty


def storage_env(cfg: StorageConfig) -> dict[str, str]:
    """The environment that points a `belayer` command (no config file) at `cfg`'s bucket."""
    return {
        "BELAYER_CONFIG": "",
        "BELAYER_STORAGE__ENDPOINT": cfg.endpoint,
        "BELAYER_STORAGE__BUCKET": cfg.bucket,
        "BELAYER_STORAGE__ACCESS_KEY": cfg.access_key.get_secret_value(),
        "BELAYER_STORAGE__SECRET_KEY": cfg.secret_key.get_secret_value(),
        "BELAYER_STORAGE__KEY_PREFIX": cfg.key_prefix,
    }
