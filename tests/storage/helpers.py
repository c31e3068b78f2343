"""Helpers for the storage tests: raw access to the bucket, behind Belayer's back."""

from __future__ import annotations

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
