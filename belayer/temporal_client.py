"""The one way Belayer connects to Temporal: one data converter, one namespace setting.

`data_converter` is the only place a converter is built: Temporal's pydantic converter,
plus the payload encryption codec (belayer/payload_codec.py) when
`temporal.encrypt_payloads` is on. Every client, worker, replayer and example goes
through it (directly, or through `connect`), so nothing reaches Temporal with payloads
in the clear once encryption is switched on.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes
from temporalio.runtime import LogForwardingConfig, LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
from temporalio.service import RPCError, RPCStatusCode

from belayer.config import TemporalConfig, missing_key_error
from belayer.errors import BelayerError
from belayer.payload_codec import EncryptionCodec


@functools.cache
def _log_through_python() -> None:
    """The SDK's core logs (e.g. retries while a server restarts) go through Python's
    logging, to stderr, not to stdout, where `--json` output must stay parseable."""

    logging_config = LoggingConfig(
        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
        forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
    )
    Runtime.set_default(
        Runtime(telemetry=TelemetryConfig(logging=logging_config)), error_if_already_set=False
    )


class TemporalUnreachable(BelayerError):
    """No Temporal frontend answers at the configured address."""


def data_converter(cfg: TemporalConfig, encryption_key=None) -> DataConverter:
    """The converter for `cfg`: pydantic payloads, encrypted under `encryption_key`
    (the `storage.encryption_key` SecretStr) when `cfg.encrypt_payloads` is on.

    Failure messages and stack traces are moved into an encoded payload too when
    encrypting: they often quote commands and their output. A payload without the
    codec's marker is then refused (`cfg.accept_plaintext_payloads` reads old histories).
    """
    if not cfg.encrypt_payloads:
        return pydantic_data_converter

    secret = (
        encryption_key.get_secret_value() if hasattr(encryption_key, "get_secret_value") else encryption_key
    )
    if not secret:
        raise missing_key_error()
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=EncryptionCodec.from_setting(secret, accept_plaintext=cfg.accept_plaintext_payloads),
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


async def connect(cfg: TemporalConfig, encryption_key=None) -> Client:
    """A client for `cfg`, or `TemporalUnreachable` naming the address and the fix.

    `encryption_key` is `storage.encryption_key`; it is required when
    `cfg.encrypt_payloads` is on (a `ConfigError` otherwise, before any connection).
    """
    converter = data_converter(cfg, encryption_key)
    _log_through_python()
    try:
        return await Client.connect(cfg.address, namespace=cfg.namespace, data_converter=converter)
    except Exception as exc:  # the SDK raises plain RuntimeError for connection failures
        raise TemporalUnreachable(
            f"cannot reach Temporal at {cfg.address} ({exc}); start the local stack with "
            "`belayer up`, or point BELAYER_TEMPORAL__ADDRESS at your Temporal cluster"
        ) from None


def server_went_away(exc: BaseException) -> bool:
    """Is `exc` a call cut by the server going away (a restart), worth asking again? A
    restart surfaces as UNAVAILABLE, a deadline, or UNKNOWN "transport error"."""

    return isinstance(exc, RPCError) and exc.status in (
        RPCStatusCode.UNAVAILABLE,
        RPCStatusCode.DEADLINE_EXCEEDED,
        RPCStatusCode.UNKNOWN,
    )


_QUEUE_KINDS = {
    "workflow": TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    "activity": TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
}


async def pollers(
    cfg: TemporalConfig, task_queue: str, queue_kind: str, encryption_key=None
) -> list[tuple[str, float]]:
    """The workers currently polling `task_queue` (`queue_kind` "workflow" or "activity"):
    (identity, seconds since its last poll). Temporal lists a worker for a while after it
    is gone; a live one polls again at least once a minute. The stack's readiness checks
    and a rollout node's duplicate-id check ask this."""
    client = await connect(cfg, encryption_key)
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=cfg.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=_QUEUE_KINDS[queue_kind],
        )
    )
    now = time.time()
    return [(poller.identity, now - poller.last_access_time.ToSeconds()) for poller in response.pollers]


WORKFLOW_UNKNOWN = "UNKNOWN"  # what `workflow_status` says of an id Temporal has no workflow for


async def workflow_status(client: Client, workflow_id: str) -> str | None:
    """Temporal's status name of the workflow's latest run; WORKFLOW_UNKNOWN when Temporal
    has no such workflow; None when Temporal did not answer (ask again later)."""
    try:
        described = await client.get_workflow_handle(workflow_id).describe()
    except RPCError as exc:
        return WORKFLOW_UNKNOWN if exc.status == RPCStatusCode.NOT_FOUND else None
    return described.status.name if described.status is not None else None
