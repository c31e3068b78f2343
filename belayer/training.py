"""Starting and following training runs from Python: what `belayer train` uses.

`TrainingInput` / `TrainingResult` (belayer.workflows.training_models) are the public
API; this module fills the defaults from the effective configuration (queues, nodes,
model, policy, token budget), gives runs readable ids, and reads a run's iteration log.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import datetime

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError

from belayer.activities.training_log import delete_batch, delete_step, run_log_key
from belayer.activities.training_log import read_iterations as read_records
from belayer.client import task_queues
from belayer.config import BelayerConfig
from belayer.errors import BelayerError
from belayer.storage.errors import ObjectConflict
from belayer.storage.recordlog import RecordLog, RecordLogRef
from belayer.storage.store import open_store
from belayer.trainer.models import TrainerSettings, checkpoint_key, weights_key
from belayer.workers.rollout.fleet import node_config, rollout_node_ids
from belayer.workers.rollout.worker import node_task_queue
from belayer.workflows.rollouts import RUN_KEY
from belayer.workflows.training_models import (
    MAX_REUSED_SETUPS,
    RECENT_RECORDS,
    IterationRecord,
    TrainingInput,
    TrainingProgress,
    TrainingQueues,
    TrainingResult,
    TrainingState,
)
from belayer.workloads.models import Task, Workload
from belayer.workloads.task_set import TASKS, encoded, store_task_set


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
# `belayer train` runs an iteration's trajectories all at once, up to this many: a sandbox
# host's default capacity (`sandbox.max_sandboxes`).
MAX_DEFAULT_CONCURRENCY = 64


# What a workload may name that it was tuned with, and each one's default.
TUNABLE_DEFAULTS = {
    "lr": TrainerSettings().lr,
    "group_size": DEFAULT_GROUP_SIZE,
    "kl_coef": TrainerSettings().kl_coef,
}


def tuned(setting: str, given, workload: Workload):
    """The `setting` (lr, group_size, kl_coef) a run on `workload` uses: the value given (0
    included: `--lr 0` is the control run), else the workload's own (what it was tuned
    with), else the default."""
    return next(
        value for value in (given, getattr(workload, setting), TUNABLE_DEFAULTS[setting]) if value is not None
    )


def default_concurrency(trained: int, heldout: list[Task] | None) -> int:
    """`belayer train`'s concurrency when none is given: the iteration's `trained`
    trajectories and its held-out ones at once (up to MAX_DEFAULT_CONCURRENCY), since the
    engines batch them: on this machine an iteration of 24 took about 34 s eight at a time
    and 20 s all at once."""
    return max(1, min(MAX_DEFAULT_CONCURRENCY, trained + len(heldout or [])))


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
    concurrency: int | None = None,
    **overrides,
) -> TrainingInput:
    """The input of a run over `tasks` with the stack's queues and policy, starting from
    `model` (default: the model the stack's engines were built from), with `belayer train`'s
    defaults for whatever is not given (set-ups reused up to MAX_REUSED_SETUPS tasks). One
    temperature serves the rollouts and the trainer: `temperature=` alone sets both,
    `settings` alone its own for both (both, differing, are refused)."""
    temperature = overrides.pop("temperature", None)
    overrides["reuse_setup"] = _reuse_setup(
        overrides.get("reuse_setup"), len(tasks), fork_groups=overrides.get("fork_groups", True)
    )
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
        concurrency=concurrency or default_concurrency(group_size * tasks_per_iteration, heldout),
        **overrides,
    )


class TooManySetups(BelayerError):
    """Set-ups reused over more tasks than a run should keep set-up checkpoints of."""


def _reuse_setup(asked: bool | None, tasks: int, *, fork_groups: bool) -> bool:
    """Whether the run reuses set-ups: as asked, else for up to MAX_REUSED_SETUPS tasks. It
    keeps a set-up checkpoint per task drawn (in its state and on the sandbox hosts) until it
    ends, so reuse over more tasks is refused (it is moot without forks)."""
    if asked is None:
        return tasks <= MAX_REUSED_SETUPS
    if asked and tasks > MAX_REUSED_SETUPS and fork_groups:
        raise TooManySetups(
            f"reuse_setup keeps a set-up checkpoint for every task drawn, in the run's state and on the sandbox "
            f"hosts, until the run ends: {tasks} tasks is more than {MAX_REUSED_SETUPS}; turn it off "
            "(`belayer train --no-reuse-setup`, reuse_setup=False): each group then sets up anew"
        )
    return asked


class RunIdReused(BelayerError):
    """A run id already names a run with other settings: its checkpoints and iteration log
    would be taken for this run's."""


def settings_key(run_id: str) -> str:
    return f"runs/{run_id}/settings.json"


def canonical_settings(input: TrainingInput) -> dict:
    """What defines a run's numbers: its input without its id, the queues it reaches and
    the state it carries (a resumed run carries its own, and is the same run)."""
    return _tasks_as_a_set(input.model_dump(mode="json", exclude={"run_id", "queues", "carried"}))


def _tasks_as_a_set(settings: dict) -> dict:
    """`settings` with inline tasks replaced by the reference they are stored under: a run
    is the same run whichever way its input carries its tasks (a run claimed before task
    sets recorded them inline, and its resume carries them so)."""
    tasks = settings.pop("tasks", None)
    if tasks:
        settings["task_set"] = encoded(TASKS.validate_python(tasks))[0].model_dump(mode="json")
    return settings


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
        recorded = _tasks_as_a_set(json.loads(store.get_bytes(settings_key(input.run_id)))["settings"])
    if recorded != settings:
        differ = sorted(k for k in settings.keys() | recorded.keys() if settings.get(k) != recorded.get(k))
        raise RunIdReused(
            f"run id {input.run_id!r} was used by a run with other settings ({', '.join(differ)} differ); "
            "pick another --run-id, or leave it out for a fresh one"
        )


def tasks_by_reference(store, input: TrainingInput) -> TrainingInput:
    """`input` with its inline tasks stored (belayer/workloads/task_set.py): its payload is
    then a pointer, whatever the dataset's size."""
    if input.task_set is not None:
        return input
    return input.model_copy(update={"tasks": [], "task_set": store_task_set(store, input.tasks)})


async def start_training(client: Client, config: BelayerConfig, input: TrainingInput) -> WorkflowHandle:
    """Start `TrainingWorkflow` with its tasks stored by reference; its id is the run id
    (the web UI finds it, and its trajectories by BelayerRun). A run id used before with
    other settings is refused."""
    with open_store(config.storage, encrypted=False) as store:
        input = tasks_by_reference(store, input)
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


class NotResumable(BelayerError):
    """The run is going, or ended complete, or never started: there is nothing to resume."""


async def resume_training(
    client: Client, config: BelayerConfig, run_id: str
) -> tuple[WorkflowHandle, TrainingInput]:
    """Continue run `run_id`, which ended failed_infra or was terminated, cancelled or timed
    out, from its record log and the checkpoint of its last recorded iteration: the same
    settings, seeds and task picks, so it ends as the run would have without stopping.

    An iteration the run had begun but not recorded runs again, whole (its trajectories
    under new ids; a checkpoint its train step wrote is removed first, since nothing
    recorded refers to it). The nodes serve the checkpoint's weights again, as a new
    version, before the first iteration samples. The run keeps its id: `belayer train
    status` and the web UI show the new execution."""
    ended, started_at = await _ended_run(client, run_id)
    with open_store(config.storage, encrypted=False) as store:
        run_log = RecordLog(store, run_log_key(run_id))
        recorded = run_log.written() if run_log.exists() else 0  # it may have stopped before it began one
        log = RecordLogRef(key=run_log_key(run_id), length=recorded)
        records = read_log(config, log)
        _remove_unrecorded_step(store, run_id, recorded, records[-1].weights_version if records else None)
    resumed = (ended.carried.resumed if ended.carried else 0) + 1  # new trajectory ids, even from the start
    carried = TrainingState(resumed=resumed)  # stopped before it recorded an iteration: from its start
    if recorded:
        carried = TrainingState(
            iteration=recorded,
            checkpoint=records[-1].checkpoint,
            serving_version=records[-1].weights_version,
            log=log,
            recent=[record.for_state() for record in records[-RECENT_RECORDS:]],
            started_at=started_at,
            resumed=resumed,
            publish_checkpoint=True,
        )
    input = ended.model_copy(update={"queues": training_queues(config), "carried": carried})
    return await start_training(client, config, input), input


async def _ended_run(client: Client, run_id: str) -> tuple[TrainingInput, datetime | None]:
    """The input of the run's latest execution (continue-as-new carries its state there)
    and when the run began; refused while it runs or when it completed."""
    handle = client.get_workflow_handle(run_id, result_type=TrainingResult)
    try:
        described = await handle.describe()
    except RPCError as exc:
        raise NotResumable(
            f"no training run {run_id!r} ({exc.message}); `belayer train status` takes the same id"
        ) from None
    if described.status == WorkflowExecutionStatus.RUNNING:
        raise NotResumable(f"run {run_id} is still running: follow it with `belayer train status {run_id}`")
    if described.status == WorkflowExecutionStatus.COMPLETED:
        result = await handle.result()
        if result.status == "completed":
            raise NotResumable(
                f"run {run_id} completed all its {result.iterations_done} iterations: nothing to resume"
            )
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            (input,) = await client.data_converter.decode(payloads, [TrainingInput])
            began = (input.carried.started_at if input.carried else None) or described.start_time
            return input, began
    raise NotResumable(f"{run_id} has no start event in its history: is it a training run?")


def _remove_unrecorded_step(store, run_id: str, recorded: int, last_version: int | None) -> None:
    """What the stopped run's train step of iteration `recorded` (the one after the last
    recorded) wrote, if it got that far: the resumed run steps that iteration again, and its
    write-once checkpoint must not meet the old one. Nothing recorded refers to either; its
    weights are version `last_version` + 1 (a run's step always publishes the version after
    the one it sampled). The samples it stored go too."""
    weights = weights_key(run_id, last_version + 1) if last_version is not None else None
    delete_step(store, checkpoint_key(run_id, recorded), weights)
    delete_batch(store, run_id, recorded)


def run_storage(config: BelayerConfig, run_id: str) -> dict:
    """What run `run_id` holds in the object store: objects and bytes under `runs/<run>/`,
    and the iterations whose trainer checkpoints are kept (`--keep-last` deletes others)."""
    prefix = f"runs/{run_id}/"
    with open_store(config.storage, encrypted=False) as store:
        objects, size = store.usage(prefix)
        trainer_dir = checkpoint_key(run_id, 0).rsplit("/", 1)[0] + "/"
        checkpoints = sorted(
            int(key.rsplit("/iteration-", 1)[1].split(".", 1)[0])
            for key in store.list(trainer_dir)
            if "/iteration-" in key
        )
    return {"objects": objects, "bytes": size, "checkpoints": checkpoints}


async def run_progress(client: Client, run_id: str) -> TrainingProgress:
    return await client.get_workflow_handle(run_id).query("progress", result_type=TrainingProgress)


def read_iterations(config: BelayerConfig, result_or_progress) -> list[IterationRecord]:
    """Every iteration the run recorded so far, from its log in the object store."""
    return read_log(config, result_or_progress.log)


def read_log(config: BelayerConfig, log: RecordLogRef | None) -> list[IterationRecord]:
    if log is None or log.length == 0:
        return []
    store = open_store(config.storage)
    try:
        return [IterationRecord.model_validate(r) for r in read_records(store, log)]
    finally:
        store.close()
