"""The rollout API: Belayer as the fault-tolerant rollout backend of a trainer it does not
own (TRL, verl, a loop of your own).

    client = await RolloutClient.connect()
    rollouts = await client.generate("examples/workloads/learn.yaml", group_size=4, seed=0)
    ...  # your loss on r.completion_ids, r.logprobs, r.loss_mask; your optimizer step
    await client.publish(model.state_dict(), version=2)

`generate` runs one `RolloutWorkflow` (belayer/workflows/rollouts.py): a group per task,
forked from one set-up sandbox, each member run again with the same seed while it ends
failed_infra — the very runner Belayer's own training loop uses, so every guarantee of
that loop holds here. Engines and sandboxes that fail on the way are recovered inside the
trajectory; what comes back never depends on them. `publish` puts a new weights version
into every rollout node with the loop's guarantees (`PublishWorkflow`).

Only pointers cross Temporal; the tokens are read here, from the object store, into the
very `Rollout` Belayer's own trainer reads and trains on (belayer/trainer/rollout.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from belayer.config import BelayerConfig, load_config
from belayer.contracts.publish import PublishWeightsResult
from belayer.errors import BelayerError
from belayer.model.build import model_path
from belayer.model.param_names import hf_state_dict
from belayer.storage.store import open_store
from belayer.storage.weights import store_weights
from belayer.temporal_client import connect
from belayer.trainer.models import RolloutRef
from belayer.trainer.rollout import Rollout, read_rollout
from belayer.training import training_queues
from belayer.workflows.groups import cause_of
from belayer.workflows.publishing import PublishRequest, PublishWorkflow, ServedVersionsWorkflow
from belayer.workflows.rollout_models import (
    RolloutQueues,
    RolloutRequest,
    RolloutResult,
    RolloutSettings,
)
from belayer.workflows.rollouts import RUN_KEY, RolloutWorkflow
from belayer.workloads.loader import load_workload
from belayer.workloads.models import Task

# What a batch runs at once when the caller does not say (a training run's default too).
DEFAULT_CONCURRENCY = 8


class RolloutError(BelayerError):
    """A batch or a publish that could not be done; the message says why and what to do."""


class RolloutClient:
    """Batches of rollouts and weight publishes on a running Belayer stack (`belayer up`)."""

    def __init__(self, config: BelayerConfig, client: Client) -> None:
        self.config = config
        self.temporal = client
        self.queues = RolloutQueues(**training_queues(config).model_dump(exclude={"trainer"}))
        self._staged: dict | None = None
        self._staged_version: int | None = None

    @classmethod
    async def connect(cls, config: BelayerConfig | None = None) -> RolloutClient:
        """A client of the stack `config` names (default: the effective configuration,
        as `belayer` commands read it)."""
        config = config or load_config()
        return cls(config, await connect(config.temporal))

    # ------------------------------------------------------------------ rollouts

    async def generate(self, tasks: str | Path | Sequence[Task], *, group_size: int, seed: int,
                       temperature: float = 1.0, max_concurrency: int | None = None,
                       weights_version: int | None = None, fork: bool = True) -> list[Rollout]:  # fmt: skip
        """A group of `group_size` rollouts of every task, in task order then member order.
        `tasks` is a workload file or a list of tasks. Seeds are hashes of (seed, task,
        member): the same call on the same weights gives the same rollouts.
        `weights_version`: the version every node must serve (else `RolloutError`).
        `fork`: each group's members fork one set-up sandbox (False: each sets up its own)."""
        settings = self._settings(group_size, seed, temperature, max_concurrency, fork)
        handle = await self._start(tasks, settings, weights_version)
        result = await self._result(handle)
        with open_store(self.config.storage, encrypted=False) as store:
            return [read_rollout(store, m) for group in result.groups for m in group.members]

    async def stream(self, tasks: str | Path | Sequence[Task], *, group_size: int, seed: int,
                     temperature: float = 1.0, max_concurrency: int | None = None,
                     weights_version: int | None = None, fork: bool = True,
                     every_s: float = 0.5) -> AsyncIterator[Rollout]:  # fmt: skip
        """The rollouts of the same batch as `generate`, each as soon as it ends."""
        settings = self._settings(group_size, seed, temperature, max_concurrency, fork)
        handle = await self._start(tasks, settings, weights_version)
        done = asyncio.ensure_future(self._result(handle))
        yielded: set[str] = set()
        try:
            with open_store(self.config.storage, encrypted=False) as store:
                while True:
                    finished = done.done()
                    for outcome in await self._finished(handle, done):
                        if outcome.trajectory_id not in yielded:
                            yielded.add(outcome.trajectory_id)
                            yield read_rollout(store, outcome)
                    if finished:
                        return
                    await asyncio.wait({done}, timeout=every_s)
        finally:
            done.cancel()

    def _settings(self, group_size, seed, temperature, max_concurrency, fork) -> RolloutSettings:
        return RolloutSettings(
            group_size=group_size,
            seed=seed,
            temperature=temperature,
            concurrency=max_concurrency or DEFAULT_CONCURRENCY,
            policy=self.config.policy,
            max_total_tokens=self.config.rollout.max_model_len,
            fork_groups=fork,
        )

    async def _start(self, tasks, settings: RolloutSettings, weights_version: int | None) -> WorkflowHandle:
        request = RolloutRequest(
            batch_id=f"rollouts-{uuid.uuid4().hex[:10]}",
            tasks=_tasks(tasks),
            settings=settings,
            queues=self.queues,
            weights_version=weights_version,
        )
        return await self.temporal.start_workflow(
            RolloutWorkflow.run,
            request,
            id=request.batch_id,
            task_queue=self.config.temporal.workflow_task_queue,
            search_attributes=TypedSearchAttributes([SearchAttributePair(RUN_KEY, request.batch_id)]),
            static_summary=f"{len(request.tasks)} groups of {settings.group_size} rollouts",
        )

    async def _result(self, handle: WorkflowHandle) -> RolloutResult:
        try:
            return await handle.result()
        except WorkflowFailureError as err:
            raise RolloutError(f"batch {handle.id} failed: {cause_of(err)}") from None

    async def _finished(self, handle: WorkflowHandle, done: asyncio.Future) -> list[RolloutRef]:
        """Every member done so far: from the result once it is in, else the progress query
        (a query that fails now, racing the start or a server restart, is asked next round)."""
        if done.done():
            return [m for group in done.result().groups for m in group.members]
        try:
            return (await handle.query(RolloutWorkflow.progress)).finished
        except Exception:
            return []

    # ------------------------------------------------------------------ weights

    async def publish(self, state_dict: dict, version: int) -> list[PublishWeightsResult]:
        """Put `state_dict` (HF or vLLM parameter names, the served model's full state) into
        every rollout node as weights `version` (greater than what they serve); returns
        once all of them serve it, one result per node."""
        weights = hf_state_dict(state_dict, model_path(self.config.rollout.model, self.config.cache_dir))
        with open_store(self.config.storage, encrypted=False) as store:
            ref = store_weights(store, f"rollout-api/weights/v{version:08d}-{uuid.uuid4().hex[:8]}", weights)
        handle = await self.temporal.start_workflow(
            PublishWorkflow.run,
            PublishRequest(version=version, weights=ref, nodes=self.queues.nodes),
            id=f"publish-v{version}-{ref.sha256[:12]}",
            task_queue=self.config.temporal.workflow_task_queue,
            static_summary=f"publish weights v{version} to {len(self.queues.nodes)} node(s)",
        )
        try:
            return await handle.result()
        except WorkflowFailureError as err:
            raise RolloutError(f"publishing v{version} failed: {cause_of(err)}") from None

    async def served_versions(self) -> dict[str, int]:
        """The weights version each node serves, by node queue: a trainer's first version
        must be greater than all of them."""
        served = await self.temporal.execute_workflow(
            ServedVersionsWorkflow.run,
            self.queues.nodes,
            id=f"served-versions-{uuid.uuid4().hex[:10]}",
            task_queue=self.config.temporal.workflow_task_queue,
            static_summary=f"weights versions of {len(self.queues.nodes)} node(s)",
        )
        return dict(zip(self.queues.nodes, served, strict=True))

    # vLLM's weight-transfer phases, for a trainer that already drives them: init once,
    # then per version start, update (once or in chunks), finish.

    def init_weight_transfer_engine(self, init_info: dict | None = None) -> None:
        """Nothing to set up: weights travel through the object store (kept for the protocol)."""

    def start_weight_update(self, version: int) -> None:
        self._staged, self._staged_version = {}, version

    def update_weights(self, named_tensors) -> None:
        """Add a chunk: a dict or (name, tensor) pairs, HF or vLLM names."""
        if self._staged is None:
            raise RolloutError("update_weights before start_weight_update: start a version first")
        self._staged.update(dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors))

    async def finish_weight_update(self) -> list[PublishWeightsResult]:
        """Publish what the chunks gave, as the version `start_weight_update` named."""
        if self._staged is None or self._staged_version is None:
            raise RolloutError("finish_weight_update before start_weight_update: start a version first")
        staged, version = self._staged, self._staged_version
        self._staged = self._staged_version = None
        return await self.publish(staged, version)


def _tasks(tasks: str | Path | Sequence[Task]) -> list[Task]:
    return load_workload(Path(tasks)).tasks if isinstance(tasks, (str, Path)) else list(tasks)
