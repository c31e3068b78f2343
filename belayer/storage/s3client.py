"""The one place a boto3 S3 client is built from a `StorageConfig`.

Retries inside botocore are off (max_attempts=1): Belayer's storage layer retries
transient errors itself, with backoff, so nothing is retried twice over.
"""

from __future__ import annotations

import boto3
from botocore.config import Config

from belayer.storage.config import StorageConfig


def make_s3_client(
    cfg: StorageConfig, *, connect_timeout_s: float | None = None, read_timeout_s: float | None = None
):
    """A boto3 S3 client for `cfg`'s endpoint (SeaweedFS, MinIO or AWS S3).

    Timeouts default to `cfg.connect_timeout_s` / `cfg.read_timeout_s`.
    """
    connect_timeout_s = cfg.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
    read_timeout_s = cfg.read_timeout_s if read_timeout_s is None else read_timeout_s
    botocore_config = Config(
        region_name=cfg.region,
        s3={"addressing_style": "path" if cfg.path_style else "auto"},
        retries={"max_attempts": 1, "mode": "standard"},
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        # Checksums only when the API demands them: doubles throughput on SeaweedFS
        # (docs/design.md §7); Belayer verifies its own sha256 of every object anyway.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        max_pool_connections=16,
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=cfg.endpoint or None,
        aws_access_key_id=cfg.access_key.get_secret_value() or None,
        aws_secret_access_key=cfg.secret_key.get_secret_value() or None,
        config=botocore_config,
    )
