"""Starting and following training runs from Python: what `belayer train` uses.

`TrainingInput` / `TrainingResult` (belayer.workflows.training_models) are the public
API; this module fills the defaults from the effective configuration (queues, nodes,
model, policy, token budget), gives runs readable ids, and reads a run's iteration log.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from belayer.activities.training_log import read_iterations as read_records
from belayer.client import task_queues
from belayer.config import BelayerConfig
from belayer.errors import BelayerError
from belayer.storage.errors import ObjectConflict
from belayer.storage.store import open_store
from belayer.trainer.models import TrainerSettings
from belayer.workers.rollout.fleet import node_config, rollout_node_ids
from belayer.workers.rollout.worker import node_task_queue
from belayer.workflows.rollouts import RUN_KEY
from belayer.workflows.training_models import (
    IterationRecord,
    TrainingInput,
    TrainingProgress,
    TrainingQueues,
    TrainingResult,
)
from belayer.workloads.models import Task


def training_queues(config: BelayerConfig) -> TrainingQueues:
    """The queues of the stack `config` reaches, with every rollout node's own (a publish
    reaches each)."""
    return TrainingQueues(
        trajectories=task_queues(config),
        workflows=config.temporal.workflow_task_queue,
        trainer=config.trainer.task_queue,
        nodes=[node_task_queue(node_config(config, node_id)) for node_id in rollout_node_ids(config)],
    )


# The shape of a run when nobody says otherwise: `belayer train`'s defaults and the library's.
DEFAULT_ITERATIONS = 24
DEFAULT_GROUP_SIZE = 4
DEFAULT_TASKS_PER_ITERATION = 4


def default_settings(iterations: int) -> TrainerSettings:
    """The trainer settings of a run nobody tuned: `TrainerSettings`' own, with the learning
    rate falling linearly to 0 over the run's `iterations` (`belayer train --lr-decay linear`)."""
    return TrainerSettings(lr_decay_iterations=iterations)


def training_input(
    config: BelayerConfig,
    tasks: list[Task],
    *,
    iterations: int = DEFAULT_ITERATIONS,
    group_size: int = DEFAULT_GROUP_SIZE,
    tasks_per_iteration: int = DEFAULT_TASKS_PER_ITERATION,
    seed: int = 0,
    heldout: list[Task] | None = None,
    settings: TrainerSettings | None = None,
    run_id: str | None = None,
    model: str | None = None,
    **overrides,
) -> TrainingInput:
    """The input of a run over `tasks` with the stack's queues and policy, starting from
    `model` (default: the model the stack's engines were built from), with `belayer train`'s
    defaults for whatever is not given. One temperature serves the rollouts and the trainer:
    `temperature=` alone sets both, `settings` alone its own for both (both, differing, are refused)."""
    temperature = overrides.pop("temperature", None)
    if settings is None:
        settings = default_settings(iterations)
        if temperature is not None:
            settings = settings.model_copy(update={"temperature": temperature})
    return TrainingInput(
        run_id=run_id or f"train-{uuid.uuid4().hex[:8]}",
        tasks=tasks,
        heldout=heldout or [],
        model=model or config.rollout.model,
        iterations=iterations,
        group_size=group_size,
        tasks_per_iteration=tasks_per_iteration,
        seed=seed,
        trainer=settings.model_copy(update={"threads": config.trainer.threads}),
        temperature=settings.temperature if temperature is None else temperature,
        policy=config.policy,
        max_total_tokens=config.rollout.max_model_len,
        queues=training_queues(config),
        **overrides,
    )


class RunIdReused(BelayerError):
    """A run id already names a run with other settings: its checkpoints and iteration log
    would be taken for this run's."""


def settings_key(run_id: str) -> str:
    return f"runs/{run_id}/settings.json"


def canonical_settings(input: TrainingInput) -> dict:
    """What defines a run's numbers: its input without its id and the queues it reaches."""
    return input.model_dump(mode="json", exclude={"run_id", "queues"})


def claim_run_id(store, input: TrainingInput) -> None:
    """Record the run's settings under its id, or check them against those recorded: a run
    id used before with other settings is refused here, before anything starts, rather
    than mix two runs' checkpoints and iteration records. The same settings again are the
    same run."""
    settings = canonical_settings(input)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    record = json.dumps({"settings_sha256": digest, "settings": settings}, sort_keys=True, indent=1).encode()
    try:
        store.put_bytes(settings_key(input.run_id), record, if_absent=True)
        return
    except ObjectConflict:
        recorded = json.loads(store.get_bytes(settings_key(input.run_id)))
    if recorded["settings_sha256"] != digest:
        differ = sorted(k for k in settings.keys() | recorded["settings"].keys()
                        if settings.get(k) != recorded["settings"].get(k))  # fmt: skip
        raise RunIdReused(
            f"run id {input.run_id!r} was used by a run with other settings ({', '.join(differ)} differ); "
            "pick another --run-id, or leave it out for a fresh one"
        )


async def start_training(client: Client, config: BelayerConfig, input: TrainingInput) -> WorkflowHandle:
    """Start `TrainingWorkflow`; its id is the run id (the web UI finds it, and its
    trajectories by BelayerRun). A run id used before with other settings is refused."""
    with open_store(config.storage, encrypted=False) as store:
        claim_run_id(store, input)
    return await client.start_workflow(
        "TrainingWorkflow",
        input,
        id=input.run_id,
        task_queue=config.temporal.workflow_task_queue,
        result_type=TrainingResult,
        search_attributes=TypedSearchAttributes([SearchAttributePair(RUN_KEY, input.run_id)]),
        static_summary=f"{input.trainer.algorithm.upper()}: {input.iterations} iterations, "
        f"{input.tasks_per_iteration} tasks x {input.group_size} trajectories",
    )


async def run_progress(client: Client, run_id: str) -> TrainingProgress:
    return await client.get_workflow_handle(run_id).query("progress", result_type=TrainingProgress)


def read_iterations(config: BelayerConfig, result_or_progress) -> list[IterationRecord]:
    """Every iteration the run recorded so far, from its log in the object store."""

    log = result_or_progress.log
    if log is None or log.length == 0:
        return []
    store = open_store(config.storage)
    try:
        return [IterationRecord.model_validate(r) for r in read_records(store, log)]
    finally:
        store.close()
