"""Shared fixtures: real local services on private ports and state directories.

Tests never use the developer's own `belayer up` stack: each session starts its own
SeaweedFS (and Temporal where needed) under a temporary state directory, on free
loopback ports, and stops exactly those processes at the end, even on failure, and
even when the run itself is terminated (`pytest_configure`).
"""

from __future__ import annotations

import os
import random
import signal
import uuid
from pathlib import Path

import pytest

from belayer.config import BelayerConfig, load_config
from belayer.stack.local import LocalStack
from belayer.stack.process import ManagedProcess
from belayer.stack.services import SeaweedFS, TemporalDevServer, port_in_use
from belayer.storage.config import StorageConfig
from belayer.storage.s3client import make_s3_client


def pytest_configure(config) -> None:
    """A run ended by SIGTERM (`timeout`, a CI job's limit) stops what it started too.

    By default SIGTERM kills pytest outright, and the session's servers, sandboxes and
    engines, started in sessions of their own, live on as orphans. As a
    KeyboardInterrupt, pytest reports the run interrupted and still tears down every
    fixture (the same path as Ctrl-C).
    """
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def free_port_block(count: int, *, with_grpc: bool) -> list[int]:
    """`count` free loopback ports (and each +10000 for SeaweedFS' gRPC when asked), all
    below the kernel's ephemeral range (32768 on): a port free now but in that range can be
    handed to another service's outgoing or internal socket (Temporal's dev server opens
    some) before ours binds it."""
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(12000, 22000, 10)
        ports = [base + i for i in range(count)]
        needed = ports + ([p + 10000 for p in ports] if with_grpc else [])
        if not any(port_in_use("127.0.0.1", p) for p in needed):
            return ports
    raise RuntimeError("no free block of loopback ports for the test services")


def isolated_config(state_dir: Path) -> BelayerConfig:
    """A configuration whose every service lives in `state_dir` on free ports."""
    s3, master, volume, filer, admin, temporal, ui = free_port_block(7, with_grpc=True)
    return load_config(
        state_dir=state_dir,
        temporal={"address": f"127.0.0.1:{temporal}", "ui_port": ui},
        storage={
            "endpoint": f"http://127.0.0.1:{s3}",
            "bucket": "belayer-test",
            "access_key": "test-access",
            "secret_key": "test-secret-" + uuid.uuid4().hex[:8],
        },
        stack={
            "seaweedfs_master_port": master,
            "seaweedfs_volume_port": volume,
            "seaweedfs_filer_port": filer,
            "seaweedfs_admin_port": admin,
        },
    )


class ServiceHandle:
    """One real service of the test session that a test may kill and start again."""

    def __init__(self, stack: LocalStack, service):
        self.stack = stack
        self.service = service
        self.process: ManagedProcess = stack.process(service)

    def start(self) -> None:
        """Start (again, on the same data) and wait until it answers."""
        self.stack._start_one(self.service, lambda _m: None, wait=True)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data directory stays."""
        proc = self.process.running()
        if proc is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        self.process.stop()


class SeaweedFSHandle(ServiceHandle):
    @property
    def storage_config(self) -> StorageConfig:
        return self.stack.config.storage

    @property
    def endpoint(self) -> str:
        return self.storage_config.endpoint


@pytest.fixture(scope="session")
def stack_config(tmp_path_factory) -> BelayerConfig:
    return isolated_config(tmp_path_factory.mktemp("belayer-state"))


def running_service(stack_config, service_type, handle_type=ServiceHandle):
    """Start the session's `service_type` and yield its handle; stop it at the end."""
    stack = LocalStack(stack_config)
    service = next(s for s in stack.services if isinstance(s, service_type))
    handle = handle_type(stack, service)
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def seaweedfs(stack_config) -> SeaweedFSHandle:
    """A private SeaweedFS with credentials enforced and the test bucket created."""
    yield from running_service(stack_config, SeaweedFS, SeaweedFSHandle)


@pytest.fixture(scope="session")
def temporal_server(stack_config) -> ServiceHandle:
    """A private Temporal dev server (sqlite file in the session's state directory)."""
    yield from running_service(stack_config, TemporalDevServer)


@pytest.fixture
def storage_config(seaweedfs) -> StorageConfig:
    """The session's storage with a key prefix of its own; its objects go afterwards."""
    prefix = f"t-{uuid.uuid4().hex[:12]}/"
    cfg = seaweedfs.storage_config.model_copy(update={"key_prefix": prefix})
    yield cfg
    if seaweedfs.process.running() is None:
        seaweedfs.start()
    delete_all_under(cfg, prefix)


def delete_all_under(cfg: StorageConfig, prefix: str) -> None:
    client = make_s3_client(cfg)
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=cfg.bucket, Prefix=prefix):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=cfg.bucket, Delete={"Objects": keys})
    for upload in client.list_multipart_uploads(Bucket=cfg.bucket, Prefix=prefix).get("Uploads", []):
        client.abort_multipart_upload(Bucket=cfg.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
