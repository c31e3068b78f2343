"""A new weights version into every rollout node: what a training run does after each
step, and what `RolloutClient.publish` asks of `PublishWorkflow` (one implementation).

Every node serves the version before the caller goes on; a publish that fails after its
retries raises `PublishFailed` naming the node and the cause. Versions only grow: a node
refuses an older one (`StaleWeightsVersion`, not retried).

Workflow code only.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from belayer.contracts.errors import CORRUPT_WEIGHTS, MODEL_NOT_BUILT, STALE_WEIGHTS_VERSION
    from belayer.contracts.publish import PUBLISH_WEIGHTS, PublishWeightsArgs, PublishWeightsResult
    from belayer.storage.store import ObjectRef
    from belayer.workflows.groups import cause_of
    from belayer.workflows.rollouts import NO_WORKER_AFTER, node_versions

PUBLISH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=10,
    non_retryable_error_types=[STALE_WEIGHTS_VERSION, CORRUPT_WEIGHTS, MODEL_NOT_BUILT],
)
PUBLISH_FAILED = "PublishFailed"


class PublishFailed(Exception):
    """A node did not take the version after its retries."""


async def publish_to_nodes(
    nodes: list[str], args: PublishWeightsArgs, summary: str
) -> list[PublishWeightsResult]:
    """Publish `args.version` to every node's queue; all of them serve it when this returns."""
    return list(await asyncio.gather(*(_publish_to(queue, args, summary) for queue in nodes)))


async def _publish_to(queue: str, args: PublishWeightsArgs, summary: str) -> PublishWeightsResult:
    try:
        return await PUBLISH_WEIGHTS.execute(
            args,
            task_queue=queue,
            schedule_to_start_timeout=NO_WORKER_AFTER,
            start_to_close_timeout=timedelta(minutes=10),
            heartbeat_timeout=timedelta(seconds=30),
            retry_policy=PUBLISH_RETRY,
            summary=f"publish weights v{args.version} ({summary}) to {queue}",
        )
    except ActivityError as err:
        raise PublishFailed(
            f"publishing weights v{args.version} to {queue} failed: {cause_of(err)}"
        ) from None


class PublishRequest(BaseModel):
    """What `RolloutClient.publish` passes to `PublishWorkflow`."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=2, description="The new version; versions only grow (1 is the built model).")
    weights: ObjectRef = Field(description="A safetensors file of the full state dict, HF parameter names.")
    nodes: list[str] = Field(min_length=1, description="Every rollout node's own queue.")


@workflow.defn(name="PublishWorkflow")
class PublishWorkflow:
    """One version published to every node, for a trainer outside Belayer's loop. Its id
    names the version, so publishing the same version twice runs it once."""

    @workflow.run
    async def run(self, input: PublishRequest) -> list[PublishWeightsResult]:
        args = PublishWeightsArgs(version=input.version, weights=input.weights)
        try:
            return await publish_to_nodes(input.nodes, args, "from the rollout API")
        except PublishFailed as failure:
            raise ApplicationError(str(failure), type=PUBLISH_FAILED, non_retryable=True) from None


@workflow.defn(name="ServedVersionsWorkflow")
class ServedVersionsWorkflow:
    """The weights version each node serves, in the order of the queues asked: where a
    trainer outside Belayer's loop starts numbering its versions."""

    @workflow.run
    async def run(self, nodes: list[str]) -> list[int]:
        return await node_versions(nodes)
