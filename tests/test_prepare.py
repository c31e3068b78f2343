"""`belayer prepare` on the real Temporal dev server and SeaweedFS: a namespace without
Belayer's search attributes and a bucket that does not exist are made ready, a second run
changes nothing, and a server that never answers is named with the fix."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest

from belayer.prepare import SEARCH_ATTRIBUTES
from belayer.storage.s3client import make_s3_client
from belayer.workflows.rollouts import ITERATION_KEY, RUN_KEY
from belayer.workflows.trajectory import STATUS_KEY, TASK_KEY
from tests.storage.helpers import storage_env


def prepare(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "belayer.cli", "prepare", *args],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


async def new_namespace(address: str) -> str:
    from google.protobuf.duration_pb2 import Duration
    from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
    from temporalio.client import Client

    name = f"prepare-{uuid.uuid4().hex[:8]}"
    client = await Client.connect(address)
    await client.workflow_service.register_namespace(
        RegisterNamespaceRequest(namespace=name, workflow_execution_retention_period=Duration(seconds=86400))
    )
    return name


async def custom_attributes(address: str, namespace: str) -> dict[str, int]:
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.client import Client

    client = await Client.connect(address, namespace=namespace)
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace)
    )
    return dict(listed.custom_attributes)


def test_the_attributes_registered_are_those_the_workflows_set():
    keys = {key.name: key.indexed_value_type for key in (TASK_KEY, STATUS_KEY, RUN_KEY, ITERATION_KEY)}
    assert set(SEARCH_ATTRIBUTES) == set(keys)
    assert SEARCH_ATTRIBUTES["BelayerIteration"] == "Int"


def test_prepare_registers_the_attributes_and_creates_the_bucket_once(temporal_server, seaweedfs):
    address = temporal_server.stack.config.temporal.address
    namespace = asyncio.run(new_namespace(address))
    storage = seaweedfs.storage_config.model_copy(update={"bucket": f"prepare-{uuid.uuid4().hex[:8]}"})
    env = storage_env(storage) | {
        "BELAYER_TEMPORAL__ADDRESS": address,
        "BELAYER_TEMPORAL__NAMESPACE": namespace,
    }
    assert not set(SEARCH_ATTRIBUTES) & set(asyncio.run(custom_attributes(address, namespace)))
    s3 = make_s3_client(storage)
    try:
        first = prepare(env)
        assert first.returncode == 0, first.stderr
        assert (
            "search attributes added: BelayerIteration, BelayerRun, BelayerStatus, BelayerTask"
            in first.stderr
        )
        assert f"bucket {storage.bucket}" in first.stderr and "created" in first.stderr
        assert set(SEARCH_ATTRIBUTES) <= set(asyncio.run(custom_attributes(address, namespace)))
        assert storage.bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]

        second = prepare(env)
        assert second.returncode == 0, second.stderr
        assert "search attributes present" in second.stderr and "created" not in second.stderr
    finally:
        s3.delete_bucket(Bucket=storage.bucket)


@pytest.mark.usefixtures("local_processes")
def test_prepare_names_a_server_that_does_not_answer(tmp_path):
    from tests.conftest import free_port_block

    (port,) = free_port_block(1, with_grpc=False)
    done = prepare({"BELAYER_CONFIG": "", "BELAYER_TEMPORAL__ADDRESS": f"127.0.0.1:{port}"}, "--wait", "1")
    assert done.returncode == 1
    assert f"Temporal at 127.0.0.1:{port}" in done.stderr and "did not answer within 1 s" in done.stderr
    assert "BELAYER_TEMPORAL__" in done.stderr and "Traceback" not in done.stderr
