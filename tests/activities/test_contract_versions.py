"""Versioned contracts for rolling upgrades (belayer/contracts/activity.py).

During a rolling upgrade a worker may receive arguments written by a newer contract
version. An additive change (a new field with a default) must be read, its unknown
field dropped; a change the worker cannot read must fail that activity at once, not
retried, with a message naming the payload's version and the worker's, instead of
burning the workflow's retries on "Failed decoding arguments".

The stack tests send hand-made payloads, as a newer writer would, to the real
`training.start_log` activity on a real Temporal dev server and object store.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from pydantic import BaseModel, ConfigDict
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

from belayer.activities.training_log import TrainingLogActivities
from belayer.config import TemporalConfig
from belayer.contracts.activity import CONTRACT_VERSION, VERSION_KEY, UnreadablePayload, read
from belayer.contracts.errors import UNREADABLE_PAYLOAD
from belayer.contracts.training_log import START_RUN_LOG
from belayer.storage.recordlog import RecordLogRef
from belayer.storage.store import open_store
from belayer.temporal_client import connect, data_converter

NEWER = CONTRACT_VERSION + 1
CONVERTER = data_converter(TemporalConfig()).payload_converter  # Belayer's (pydantic)


def written_by(version: int | None, data: dict) -> Payload:
    """A JSON payload as a writer of contract `version` sends it (None: from before versions)."""
    metadata = {"encoding": b"json/plain"}
    if version is not None:
        metadata[VERSION_KEY] = str(version).encode()
    return Payload(metadata=metadata, data=json.dumps(data).encode())


class Handle(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")

    handle: Handle
    handles: list[Handle] = []
    count: int = 0


# --- reading, alone --------------------------------------------------------------------


def test_unknown_fields_are_dropped_at_any_depth():
    payload = written_by(
        NEWER,
        {
            "handle": {"key": "a", "host": "h1"},
            "handles": [{"key": "b", "zone": 2}],
            "count": 3,
            "priority": "high",
        },
    )
    assert read(payload, Args, CONVERTER, what="x") == Args(
        handle=Handle(key="a"), handles=[Handle(key="b")], count=3
    )


def test_a_payload_from_before_versions_is_read_as_version_one():
    payload = written_by(None, {"handle": {"key": "a"}})
    assert read(payload, Args, CONVERTER, what="x") == Args(handle=Handle(key="a"))
    with pytest.raises(UnreadablePayload) as caught:
        read(written_by(None, {"handle": {"name": "a"}}), Args, CONVERTER, what="x")
    assert caught.value.written_by == 1


def test_a_changed_required_field_names_both_versions_and_not_the_values():
    payload = written_by(NEWER, {"handle": {"name": "secret-value"}})
    with pytest.raises(UnreadablePayload) as caught:
        read(payload, Args, CONVERTER, what="the arguments of activity 'x'")
    message = str(caught.value)
    assert f"contract version {NEWER} (newer: upgrade this worker)" in message
    assert f"this worker reads contract version {CONTRACT_VERSION}" in message
    assert "handle.key: Field required" in message
    assert "secret-value" not in message


def test_results_without_a_body_and_plain_values_read_as_before():
    assert read(CONVERTER.to_payload(None), None, CONVERTER, what="x") is None
    assert read(CONVERTER.to_payload(7), int, CONVERTER, what="x") == 7


# --- through Temporal, against the real activity ---------------------------------------------


@workflow.defn(name="NewerWriter", sandboxed=False)  # a stand-in caller: nothing to guard
class NewerWriter:
    """Sends `training.start_log` the JSON `data` stamped as written by contract `version`;
    returns the result and the version the worker stamped it with, or how the activity failed."""

    @workflow.run
    async def run(self, data: dict, version: int) -> dict:
        try:
            raw = await workflow.execute_activity(
                START_RUN_LOG.name,
                RawValue(written_by(version, data)),
                result_type=RawValue,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100), maximum_attempts=3),
            )
        except ActivityError as err:
            cause = err.cause
            assert isinstance(cause, ApplicationError)
            return {
                "failed": cause.type,
                "non_retryable": cause.non_retryable,
                "message": cause.message,
                "retry_state": err.retry_state.name if err.retry_state else None,
            }
        ref = RecordLogRef.model_validate_json(raw.payload.data)
        return {"log": ref.key, "result_version": raw.payload.metadata[VERSION_KEY].decode()}


@workflow.defn(name="StampedByTheHelper", sandboxed=False)
class StampedByTheHelper:
    """The version a contract's arguments carry when a workflow sends them."""

    @workflow.run
    async def run(self) -> str:
        arguments = START_RUN_LOG._arguments(START_RUN_LOG.args(run_id="r"))
        return arguments[0].payload.metadata[VERSION_KEY].decode()


@pytest.fixture
async def client_and_queue(temporal_server, seaweedfs, stack_config, storage_config):
    """A worker serving the real training-log activities and the test workflows."""
    queue = f"contracts-{uuid.uuid4().hex[:8]}"
    client = await connect(stack_config.temporal, stack_config.storage.encryption_key)
    store = open_store(storage_config, encrypted=False)
    async with Worker(
        client,
        task_queue=queue,
        workflows=[NewerWriter, StampedByTheHelper],
        activities=TrainingLogActivities(store).all(),
    ):
        yield client, queue
    store.close()


async def send(client_and_queue, data: dict, version: int) -> dict:
    client, queue = client_and_queue
    return await client.execute_workflow(
        NewerWriter.run,
        args=[data, version],
        id=f"{queue}-{uuid.uuid4().hex[:6]}",
        task_queue=queue,
        result_type=dict,
    )


async def test_a_newer_payload_with_a_changed_required_field_fails_at_once_naming_both_versions(
    client_and_queue,
):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    outcome = await send(client_and_queue, {"run": run_id}, NEWER)  # `run_id` renamed: not an additive change
    assert outcome["failed"] == UNREADABLE_PAYLOAD
    assert outcome["non_retryable"] and outcome["retry_state"] == "NON_RETRYABLE_FAILURE"
    assert f"written by contract version {NEWER}" in outcome["message"]
    assert f"this worker reads contract version {CONTRACT_VERSION}" in outcome["message"]
    assert "training.start_log" in outcome["message"]


async def test_a_newer_payload_with_only_an_extra_field_is_served(client_and_queue):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    outcome = await send(client_and_queue, {"run_id": run_id, "labels": {"team": "rl"}}, NEWER)
    assert outcome == {"log": f"runs/{run_id}/iterations", "result_version": str(CONTRACT_VERSION)}


async def test_what_a_workflow_sends_through_a_contract_carries_its_version(client_and_queue):
    client, queue = client_and_queue
    stamped = await client.execute_workflow(StampedByTheHelper.run, id=f"{queue}-stamped", task_queue=queue)
    assert stamped == str(CONTRACT_VERSION)
