"""`TrainingWorkflow`: the durable RL loop of one training run (GRPO unless its
`trainer.algorithm` names another, belayer/trainer/algorithms/).

Each iteration: pick tasks (seeded) → a group of `group_size` child `TrajectoryWorkflow`s
per task (search attributes BelayerRun and BelayerIteration; `concurrency` at once) →
each group's advantages (the algorithm's estimator) → one `trainer.train_step` on the trainer's queue, which
checkpoints the trainer state write-once before it returns → the new weights published
to every rollout node → the iteration's record in the run's record log.

Infrastructure failures never become rewards: a member that ends `failed_infra` (or
whose child workflow fails) is run again as a fresh trajectory with the same seed, up
to `max_infra_retries` times; a group still incomplete after that is dropped whole from
the batch, so no group's baseline is computed from part of it, and the record says why.
`failed_policy` is a real reward, a sandbox the member's agent broke itself included (the
trajectory ends failed_policy with reward 0, not failed_infra), so no group is dropped for
what an agent did. Everything a member's outcome depends on (its task,
seed and the weights version) is fixed by the iteration, so with a deterministic
workload the run's rewards and weights do not depend on what failed on the way.

Workflow code only: no I/O, clocks or randomness outside Temporal's APIs; the task pick
and the seeds are hashes of (seed, iteration, task, member).
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from belayer.contracts.activity import Activity
    from belayer.contracts.errors import (
        BAD_TRAIN_REQUEST,
        CORRUPT_SAMPLE,
        CORRUPT_WEIGHTS,
        MODEL_NOT_BUILT,
        STALE_WEIGHTS_VERSION,
    )
    from belayer.contracts.publish import (
        PUBLISH_WEIGHTS,
        WEIGHTS_VERSION,
        PublishWeightsArgs,
        PublishWeightsResult,
    )
    from belayer.contracts.trainer import (
        TRAIN_STEP,
        Algorithm,
        SkippedGroup,
        TrainSample,
        TrainStepArgs,
        TrainStepResult,
        algorithm,
    )
    from belayer.contracts.training_log import (
        RECORD_ITERATION,
        START_RUN_LOG,
        RecordIterationArgs,
        StartRunLogArgs,
    )
    from belayer.storage.recordlog import RecordLogRef
    from belayer.workflows.groups import GroupRecord, cause_of, run_member
    from belayer.workflows.groups import prepare as prepare_group
    from belayer.workflows.groups import release as release_group
    from belayer.workflows.models import ForkStart, Sampling, TrajectoryInput, TrajectoryResult
    from belayer.workflows.training_models import (
        RECENT_RECORDS,
        IterationRecord,
        MemberOutcome,
        Phase,
        TrainingInput,
        TrainingProgress,
        TrainingResult,
        TrainingState,
        TrainingStatus,
    )
    from belayer.workflows.trajectory import STATUS_KEY, TASK_KEY
    from belayer.workloads.models import Task

RUN_KEY = SearchAttributeKey.for_keyword("BelayerRun")
ITERATION_KEY = SearchAttributeKey.for_int("BelayerIteration")

TRAINER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=20,
    non_retryable_error_types=[CORRUPT_SAMPLE, BAD_TRAIN_REQUEST],
)
PUBLISH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=10,
    non_retryable_error_types=[STALE_WEIGHTS_VERSION, CORRUPT_WEIGHTS, MODEL_NOT_BUILT],
)
# The trainer heartbeats every second while it steps: a dead one is noticed within this.
TRAINER_HEARTBEAT = timedelta(seconds=20)
STORAGE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=10)
# A queue nobody polls this long has no worker: the run ends failed_infra and says which.
NO_WORKER_AFTER = timedelta(minutes=10)


class RunFailure(Exception):
    """The run cannot go on for an infrastructure reason."""


@workflow.defn(name="TrainingWorkflow")
class TrainingWorkflow:
    @workflow.init
    def __init__(self, input: TrainingInput) -> None:
        self.input = input
        self.algorithm: Algorithm = algorithm(input.trainer.algorithm)
        self.state = input.carried or TrainingState()
        self.status: TrainingStatus = "running"
        self.phase: Phase = "starting"
        self.members_done = 0
        self.members_total = 0
        self.running: set[str] = set()
        self.group_records: list[GroupRecord] = []
        self.first_iteration_of_run = self.state.iteration
        self.limit = asyncio.Semaphore(input.concurrency)

    @workflow.query(name="progress")
    def progress(self) -> TrainingProgress:
        return TrainingProgress(
            run_id=self.input.run_id,
            status=self.status,
            iteration=self.state.iteration,
            iterations=self.input.iterations,
            phase=self.phase,
            members_done=self.members_done,
            members_total=self.members_total,
            running=sorted(self.running),
            serving_version=self.state.serving_version,
            recent=self.state.recent,
            log=self.state.log,
        )

    @workflow.run
    async def run(self, input: TrainingInput) -> TrainingResult:
        try:
            if self.state.log is None:
                await self._start()
            while self.state.iteration < input.iterations:
                if self._should_continue_as_new():
                    workflow.continue_as_new(
                        input.model_copy(
                            update={
                                "carried": self.state.model_copy(update={"runs": self.state.runs + 1}),
                            }
                        )
                    )
                await self._iteration(self.state.iteration)
        except RunFailure as failure:
            self.status = "failed_infra"
            await self._release_origins()
            return self._result(reason=str(failure))
        await self._release_origins()
        self.status, self.phase = "completed", "done"
        return self._result()

    # ---------------------------------------------------------------- start

    async def _start(self) -> None:
        """Open the run's record log and make every node serve the model the trainer starts
        from, as a new version (versions only grow): a node may serve another run's weights,
        or have been built from another model than the run's (say `tiny`, for a `tiny-warm` run),
        so the first iteration samples exactly the trainer's start."""
        log = await self._record_activity(
            START_RUN_LOG,
            StartRunLogArgs(run_id=self.input.run_id),
            summary="create the run's iteration log",
        )
        versions = await asyncio.gather(*(self._node_version(queue) for queue in self.input.queues.nodes))
        serving = max(versions) + 1
        await self._publish(
            serving, weights=None, model=self.input.model, summary=f"the built {self.input.model}"
        )
        self.state = self.state.model_copy(update={"log": log, "serving_version": serving})

    async def _node_version(self, queue: str) -> int:
        try:
            return await WEIGHTS_VERSION.execute(
                task_queue=queue,
                schedule_to_start_timeout=NO_WORKER_AFTER,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=STORAGE_RETRY,
                summary=f"weights version served by {queue}",
            )
        except ActivityError as err:
            raise RunFailure(f"rollout node queue {queue} does not answer: {cause_of(err)}") from None

    # ---------------------------------------------------------------- one iteration

    async def _iteration(self, iteration: int) -> None:
        began = workflow.now()
        if self.state.started_at is None:
            self.state = self.state.model_copy(update={"started_at": began})
        tasks = self._pick_tasks(iteration)
        workflow.upsert_search_attributes([ITERATION_KEY.value_set(iteration)])
        self.phase, self.members_done = "rollout", 0
        self.members_total = len(tasks) * self.input.group_size + len(self.input.heldout)
        self.group_records = []
        groups, heldout = await asyncio.gather(
            asyncio.gather(*(self._group(iteration, task) for task in tasks)),
            self._heldout(iteration),
        )
        rolled_out = workflow.now()
        samples, dropped = self._batch(tasks, groups)
        self.phase = "train"
        step = await self._train(iteration, samples)
        trained = workflow.now()
        self.phase = "publish"
        version = step.checkpoint.weights_version
        await self._publish(version, weights=step.checkpoint.weights, summary=f"iteration {iteration}")
        published = workflow.now()
        record = self._record(
            iteration,
            tasks,
            groups,
            heldout,
            dropped + step.skipped,
            step,
            times=(
                (rolled_out - began).total_seconds(),
                (trained - rolled_out).total_seconds(),
                (published - trained).total_seconds(),
                (published - self.state.started_at).total_seconds(),
            ),
        )
        await self._record_activity(
            RECORD_ITERATION,
            RecordIterationArgs(
                log=self.state.log, position=iteration + 1, record=record.model_dump(mode="json")
            ),
            summary=f"record iteration {iteration}",
        )
        workflow.set_current_details(_details(record))
        self.state = self.state.model_copy(
            update={
                "iteration": iteration + 1,
                "checkpoint": step.checkpoint,
                "serving_version": version,
                "log": RecordLogRef(key=self.state.log.key, length=iteration + 1),
                "recent": [*self.state.recent, record][-RECENT_RECORDS:],
            }
        )

    def _pick_tasks(self, iteration: int) -> list[Task]:
        """`tasks_per_iteration` distinct tasks, ranked by a hash of (seed, iteration, id)."""
        ranked = sorted(self.input.tasks, key=lambda task: _digest(self.input.seed, iteration, task.id))
        return ranked[: self.input.tasks_per_iteration]

    async def _group(self, iteration: int, task: Task) -> list[MemberOutcome]:
        """The group's members, forked from one set-up sandbox (belayer/workflows/groups.py)
        when `fork_groups`; their retries start alone."""
        size = self.input.group_size
        starts: list[ForkStart | None] = [None] * size
        record = replaced = None
        if self.input.fork_groups:
            ids = [
                self._trajectory_id(iteration, task, member, prefix="", attempt=0) for member in range(size)
            ]
            kept = self.state.origins.get(task.id) if self.input.reuse_setup else None
            record, starts = await prepare_group(self._group_id(iteration, task), task, ids,
                                                 self.input.queues.trajectories, reuse=kept)  # fmt: skip
            self.group_records.append(record)
            if self.input.reuse_setup and record.origin is not None and record.reused_from is None:
                replaced = self._keep_origin(task.id, record)
        try:
            return list(
                await asyncio.gather(
                    *(
                        self._member(iteration, task, member, prefix="", start=starts[member])
                        for member in range(size)
                    )
                )
            )
        finally:
            for done in [record if not self.input.reuse_setup else None, replaced]:
                if done is not None:
                    await release_group(done, self.input.queues.trajectories)

    def _keep_origin(self, task_id: str, record: GroupRecord) -> GroupRecord | None:
        """Later groups of `task_id` fork this group's setup; returns the one it replaces
        (its fork failed: no member uses it)."""
        replaced = self.state.origins.get(task_id)
        self.state = self.state.model_copy(update={"origins": {**self.state.origins, task_id: record}})
        return replaced

    async def _release_origins(self) -> None:
        """Delete every set-up checkpoint the run kept: no member will fork or recover from one."""
        kept = list(self.state.origins.values())
        await asyncio.gather(*(release_group(r, self.input.queues.trajectories) for r in kept))
        self.state = self.state.model_copy(update={"origins": {}})

    async def _heldout(self, iteration: int) -> list[MemberOutcome]:
        return list(
            await asyncio.gather(
                *(self._member(iteration, task, 0, prefix="heldout-") for task in self.input.heldout)
            )
        )

    def _trajectory_id(self, iteration: int, task: Task, member: int, *, prefix: str, attempt: int) -> str:
        return f"{self.input.run_id}-i{iteration:05d}-{prefix}{task.id}-m{member}-a{attempt}"

    def _group_id(self, iteration: int, task: Task) -> str:
        return f"{self.input.run_id}-i{iteration:05d}-{task.id}"

    async def _member(self, iteration: int, task: Task, member: int, *, prefix: str,
                      start: ForkStart | None = None) -> MemberOutcome:  # fmt: skip
        """One trajectory of the group, run again (same seed) while it ends failed_infra;
        the first attempt starts from `start` (its group's fork), a retry alone."""
        seed = _digest(self.input.seed, iteration, prefix + task.id, member) % 2**31
        outcome, recovery_s = None, 0.0
        for attempt in range(self.input.max_infra_retries + 1):
            trajectory_id = self._trajectory_id(iteration, task, member, prefix=prefix, attempt=attempt)
            async with self.limit:
                self.running.add(trajectory_id)
                try:
                    result = await self._trajectory(iteration, task, trajectory_id, seed,
                                                    start if attempt == 0 else None)  # fmt: skip
                finally:
                    self.running.discard(trajectory_id)
            recovery_s += sum(r.time_lost_s for r in result.recoveries)
            outcome = MemberOutcome(
                trajectory_id=trajectory_id,
                status=result.status,
                reward=result.reward,
                attempts=attempt + 1,
                reason=result.reason,
                context=result.context,
                recovery_s=recovery_s,
            )
            if result.status != "failed_infra":
                break
        self.members_done += 1
        return outcome

    async def _trajectory(self, iteration: int, task: Task, trajectory_id: str, seed: int,
                          start: ForkStart | None) -> TrajectoryResult:  # fmt: skip
        """The child trajectory's result; a child that fails outright counts as failed_infra."""
        input = TrajectoryInput(
            trajectory_id=trajectory_id,
            task=task,
            sampling=Sampling(temperature=self.input.temperature, seed=seed),
            policy=self.input.policy,
            queues=self.input.queues.trajectories,
            max_total_tokens=self.input.max_total_tokens,
            max_recoveries=self.input.max_recoveries,
            start_from=start,
        )
        return await run_member(
            input,
            task_queue=self.input.queues.workflows,
            summary=f"iteration {iteration}: {task.id}",
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(TASK_KEY, task.id),
                    SearchAttributePair(STATUS_KEY, "running"),
                    SearchAttributePair(RUN_KEY, self.input.run_id),
                    SearchAttributePair(ITERATION_KEY, iteration),
                ]
            ),
        )

    def _batch(
        self, tasks: list[Task], groups: list[list[MemberOutcome]]
    ) -> tuple[list[TrainSample], list[SkippedGroup]]:
        """Complete groups with their advantages; an incomplete group is dropped whole."""
        samples, dropped = [], []
        for task, members in zip(tasks, groups, strict=True):
            lost = [m for m in members if m.status == "failed_infra"]
            if lost:
                dropped.append(
                    SkippedGroup(
                        group=task.id,
                        reason=(
                            f"{len(lost)} of {len(members)} members failed_infra after "
                            f"{self.input.max_infra_retries} retries: {lost[0].reason[:200]}"
                        ),
                    )
                )
                continue
            advantages = self.algorithm.advantages([m.reward for m in members])
            for member, advantage in zip(members, advantages, strict=True):
                samples.append(
                    TrainSample(
                        trajectory_id=member.trajectory_id,
                        group=task.id,
                        context=member.context,
                        advantage=advantage,
                    )
                )
        return samples, dropped

    async def _train(self, iteration: int, samples: list[TrainSample]) -> TrainStepResult:
        args = TrainStepArgs(
            run_id=self.input.run_id,
            iteration=iteration,
            model=self.input.model,
            base=self.state.checkpoint,
            samples=samples,
            settings=self.input.trainer,
            sampled_version=self.state.serving_version,
            weights_version=self.state.serving_version + 1,
        )
        try:
            return await TRAIN_STEP.execute(
                args,
                task_queue=self.input.queues.trainer,
                schedule_to_start_timeout=NO_WORKER_AFTER,
                start_to_close_timeout=timedelta(hours=2),
                heartbeat_timeout=TRAINER_HEARTBEAT,
                retry_policy=TRAINER_RETRY,
                summary=f"iteration {iteration}: {self.algorithm.name.upper()} step on {len(samples)} trajectories",
            )
        except ActivityError as err:
            raise RunFailure(f"train step of iteration {iteration} failed: {cause_of(err)}") from None

    async def _publish(self, version: int, *, weights, summary: str, model: str | None = None) -> None:
        """Publish `version` to every node; all of them serve it before the run goes on."""
        args = PublishWeightsArgs(version=version, weights=weights, model=model)
        await asyncio.gather(*(self._publish_to(queue, args, summary) for queue in self.input.queues.nodes))

    async def _publish_to(self, queue: str, args: PublishWeightsArgs, summary: str) -> PublishWeightsResult:
        version = args.version
        try:
            return await PUBLISH_WEIGHTS.execute(
                args,
                task_queue=queue,
                schedule_to_start_timeout=NO_WORKER_AFTER,
                start_to_close_timeout=timedelta(minutes=10),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=PUBLISH_RETRY,
                summary=f"publish weights v{version} ({summary}) to {queue}",
            )
        except ActivityError as err:
            raise RunFailure(f"publishing weights v{version} to {queue} failed: {cause_of(err)}") from None

    def _record(
        self, iteration, tasks, groups, heldout, dropped, step: TrainStepResult, *, times
    ) -> IterationRecord:
        dropped_names = {d.group for d in dropped}
        kept = [
            m.reward
            for task, members in zip(tasks, groups, strict=True)
            if task.id not in dropped_names
            for m in members
        ]
        evaluated = [m.reward for m in heldout if m.reward is not None]
        rollout_s, train_s, publish_s, elapsed_s = times
        return IterationRecord(
            iteration=iteration,
            tasks=[t.id for t in tasks],
            rewards=[[m.reward for m in members] for members in groups],
            mean_reward=sum(kept) / len(kept) if kept else None,
            heldout_reward=sum(evaluated) / len(evaluated) if evaluated else None,
            groups_kept=len(tasks) - len(dropped_names),
            groups_dropped=len(dropped_names),
            dropped=dropped,
            infra_retries=sum(m.attempts - 1 for members in [*groups, heldout] for m in members),
            weights_version=step.checkpoint.weights_version,
            weights_sha256=step.weights_sha256,
            checkpoint=step.checkpoint,
            loss=step.loss,
            kl=step.kl,
            clip_fraction=step.clip_fraction,
            trained_tokens=step.trained_tokens,
            trainer_resumed_from=step.resumed_from,
            rollout_s=rollout_s,
            train_s=train_s,
            publish_s=publish_s,
            elapsed_s=elapsed_s,
            recovery_s=sum(m.recovery_s for members in [*groups, heldout] for m in members),
            group_sandboxes=sorted(self.group_records, key=lambda r: r.group),
        )

    # ---------------------------------------------------------------- plumbing

    def _should_continue_as_new(self) -> bool:
        done_this_run = self.state.iteration - self.first_iteration_of_run
        return (
            done_this_run >= self.input.continue_as_new_every
            or workflow.info().is_continue_as_new_suggested()
        )

    async def _record_activity(self, activity: Activity, args, *, summary):
        try:
            return await activity.execute(
                args,
                task_queue=self.input.queues.workflows,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=STORAGE_RETRY,
                summary=summary,
            )
        except ActivityError as err:
            raise RunFailure(f"{activity.name} failed: {cause_of(err)}") from None

    def _result(self, reason: str = "") -> TrainingResult:
        checkpoint = self.state.checkpoint
        return TrainingResult(
            run_id=self.input.run_id,
            status=self.status,
            reason=reason,
            iterations_done=self.state.iteration,
            final_weights_sha256=checkpoint.weights.sha256 if checkpoint else None,
            checkpoint=checkpoint,
            log=self.state.log,
        )


def _details(record: IterationRecord) -> str:
    """What the web UI shows as the run's current details: the latest iteration."""
    reward = "-" if record.mean_reward is None else f"{record.mean_reward:.3f}"
    heldout = "" if record.heldout_reward is None else f", held-out {record.heldout_reward:.3f}"
    return (
        f"iteration {record.iteration} done: reward {reward}{heldout}, groups {record.groups_kept} kept / "
        f"{record.groups_dropped} dropped, weights v{record.weights_version} {record.weights_sha256[:12]}"
    )


def _digest(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")
