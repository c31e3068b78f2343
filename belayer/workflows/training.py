"""`TrainingWorkflow`: the durable RL loop of one training run (GRPO unless its
`trainer.algorithm` names another, belayer/trainer/algorithms/).

Each iteration: pick tasks (seeded) → a group of `group_size` child `TrajectoryWorkflow`s
per task, run by `GroupRunner` (belayer/workflows/rollouts.py, the same runner a
`RolloutClient` batch uses: forks, seeds, retries of failed_infra members) → each group's
advantages (the algorithm's estimator) → one `trainer.train_step` on the trainer's queue,
which checkpoints the trainer state write-once before it returns → the new weights
published to every rollout node (belayer/workflows/publishing.py) → the iteration's
record in the run's record log.

Infrastructure failures never become rewards: a group with a member still `failed_infra`
after its retries is dropped whole from the batch, so no group's baseline is computed
from part of it, and the record says why. `failed_policy` is a real reward, a sandbox the
member's agent broke itself included (the trajectory ends failed_policy with reward 0,
not failed_infra), so no group is dropped for what an agent did. Everything a member's
outcome depends on (its task, seed and the weights version) is fixed by the iteration,
so with a deterministic workload the run's rewards and weights do not depend on what
failed on the way.

Workflow code only: no I/O, clocks or randomness outside Temporal's APIs; the task pick
and the seeds are hashes of (seed, iteration, task, member).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from belayer.contracts.activity import Activity
    from belayer.contracts.batches import PICK_TASKS, STORE_SAMPLES, PickTasksArgs, StoreSamplesArgs, parts
    from belayer.contracts.errors import BAD_TRAIN_REQUEST, CORRUPT_SAMPLE
    from belayer.contracts.publish import PublishWeightsArgs
    from belayer.contracts.trainer import (
        START_WEIGHTS,
        TRAIN_STEP,
        Algorithm,
        RolloutRef,
        SkippedGroup,
        StartWeightsArgs,
        TrainSample,
        TrainStepArgs,
        TrainStepResult,
        algorithm,
    )
    from belayer.contracts.training_log import (
        PRUNE_CHECKPOINT,
        RECORD_ITERATION,
        START_RUN_LOG,
        PruneCheckpointArgs,
        RecordIterationArgs,
        StartRunLogArgs,
    )
    from belayer.seeding import digest
    from belayer.storage.recordlog import RecordLogRef
    from belayer.workflows.groups import cause_of
    from belayer.workflows.publishing import PublishFailed, publish_to_nodes
    from belayer.workflows.rollouts import (
        ITERATION_KEY,
        NO_WORKER_AFTER,
        STORAGE_RETRY,
        GroupRunner,
        node_versions,
    )
    from belayer.workflows.training_models import (
        RECENT_RECORDS,
        IterationRecord,
        Phase,
        TrainingInput,
        TrainingProgress,
        TrainingResult,
        TrainingState,
        TrainingStatus,
    )
    from belayer.workloads.models import Task
    from belayer.workloads.task_set import pick

# Runs started after this change publish their start from the trainer's bytes (replays of
# earlier runs keep publishing the nodes' own build).
START_FROM_TRAINER_BYTES = "start-from-trainer-bytes"
# Runs started after this change send their train step its samples stored in parts
# (belayer/trainer/batch.py), not inline.
SAMPLES_BY_REFERENCE = "samples-by-reference"
TRAINER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=20,
    non_retryable_error_types=[CORRUPT_SAMPLE, BAD_TRAIN_REQUEST],
)
# The trainer heartbeats every second while it steps: a dead one is noticed within this.
TRAINER_HEARTBEAT = timedelta(seconds=20)


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
        self.members_total = 0
        self.first_iteration_of_run = self.state.iteration
        self.runner = GroupRunner(input.run_id, input.rollout_settings(), input.queues, self.state.origins,
                                  resumed=self.state.resumed)  # fmt: skip

    @workflow.query(name="progress")
    def progress(self) -> TrainingProgress:
        return TrainingProgress(
            run_id=self.input.run_id,
            status=self.status,
            iteration=self.state.iteration,
            iterations=self.input.iterations,
            phase=self.phase,
            members_done=len(self.runner.finished),
            members_total=self.members_total,
            running=sorted(self.runner.running),
            serving_version=self.state.serving_version,
            recent=self.state.recent,
            log=self.state.log,
        )

    @workflow.run
    async def run(self, input: TrainingInput) -> TrainingResult:
        try:
            if self.state.log is None:
                await self._start()
            elif self.state.publish_checkpoint:
                await self._serve_checkpoint_again()
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
            await self.runner.release_origins()
            return self._result(reason=str(failure))
        await self.runner.release_origins()
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
        serving = await self._next_version()
        if workflow.patched(START_FROM_TRAINER_BYTES):
            weights = await self._start_weights(serving)
            summary = f"the trainer's {self.input.model}, sha256 {weights.sha256[:12]}"
            await self._publish(serving, weights=weights, summary=summary)
        else:  # a run started before its start was published from the trainer's bytes
            await self._publish(
                serving, weights=None, model=self.input.model, summary=f"the built {self.input.model}"
            )
        self.state = self.state.model_copy(update={"log": log, "serving_version": serving})

    async def _serve_checkpoint_again(self) -> None:
        """A resumed run's start: every node serves the last recorded checkpoint's weights,
        as a new version (versions only grow; since the run stopped the nodes may have served
        other weights, or been rebuilt), before the next iteration samples with them."""
        serving, checkpoint = await self._next_version(), self.state.checkpoint
        await self._publish(serving, weights=checkpoint.weights,
                            summary=f"resume: iteration {checkpoint.iteration}'s weights again")  # fmt: skip
        self.state = self.state.model_copy(update={"serving_version": serving, "publish_checkpoint": False})

    async def _next_version(self) -> int:
        """The version above every node's: the run's start is published as it, and so is a
        resumed run's checkpoint."""
        try:
            versions = await node_versions(self.input.queues.nodes)
        except ApplicationError as err:
            raise RunFailure(err.message) from None
        return max(versions) + 1

    async def _start_weights(self, version: int):
        """The trainer's own start, stored: the nodes verify its sha256 as they load it, so
        they serve exactly what the first train step steps from."""
        try:
            return await START_WEIGHTS.execute(
                StartWeightsArgs(run_id=self.input.run_id, model=self.input.model, version=version),
                task_queue=self.input.queues.trainer,
                schedule_to_start_timeout=NO_WORKER_AFTER,
                start_to_close_timeout=timedelta(minutes=10),
                heartbeat_timeout=TRAINER_HEARTBEAT,
                retry_policy=TRAINER_RETRY,
                summary=f"store the trainer's {self.input.model} as weights v{version}",
            )
        except ActivityError as err:
            raise RunFailure(f"storing the run's start failed: {cause_of(err)}") from None

    # ---------------------------------------------------------------- one iteration

    async def _iteration(self, iteration: int) -> None:
        began = workflow.now()
        if self.state.started_at is None:
            self.state = self.state.model_copy(update={"started_at": began})
        tasks = await self._pick_tasks(iteration)
        workflow.upsert_search_attributes([ITERATION_KEY.value_set(iteration)])
        self.phase = "rollout"
        self.members_total = len(tasks) * self.input.group_size + len(self.input.heldout)
        self.runner.begin(self.members_total)
        groups, heldout = await asyncio.gather(
            asyncio.gather(*(self.runner.group(iteration, task) for task in tasks)),
            self.runner.heldout(iteration, self.input.heldout),
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
                "recent": [*self.state.recent, record.for_state()][-RECENT_RECORDS:],
                "origins": self.runner.origins,
            }
        )
        await self._retire(iteration)

    async def _retire(self, iteration: int) -> None:
        """With `keep_last`: delete the checkpoint that has just fallen `keep_last` behind,
        unless it is an every-`keep_every`-th one. Only runs that set retention call this
        (a run from before it was there replays without it). A deletion that fails after its
        retries leaves the checkpoint and says so: it costs storage, never the run."""
        if self.input.keep_last is None:
            return
        leaving = iteration - self.input.keep_last
        if leaving < 0 or self.input.kept(leaving):
            return
        try:
            await self._record_activity(
                PRUNE_CHECKPOINT,
                PruneCheckpointArgs(log=self.state.log, iteration=leaving, run_id=self.input.run_id),
                summary=f"retention: delete iteration {leaving}'s checkpoint and weights",
            )
        except RunFailure as failure:
            workflow.logger.warning("iteration %d's checkpoint was kept: %s", leaving, failure)

    async def _pick_tasks(self, iteration: int) -> list[Task]:
        """`tasks_per_iteration` distinct tasks, ranked by a hash of (seed, iteration, id):
        drawn here from tasks given inline, by an activity from a stored task set."""
        count = self.input.tasks_per_iteration
        if self.input.task_set is None:
            return pick(self.input.tasks, self.input.seed, iteration, count)
        picked = await self._record_activity(
            PICK_TASKS,
            PickTasksArgs(
                task_set=self.input.task_set, seed=self.input.seed, iteration=iteration, count=count
            ),
            summary=f"iteration {iteration}: draw {count} of the run's {self.input.task_set.count} tasks",
        )
        return picked.tasks

    def _batch(
        self, tasks: list[Task], groups: list[list[RolloutRef]]
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
            rewards = [m.reward for m in members]
            if self.input.skip_uniform_groups and _uniform(rewards):
                dropped.append(SkippedGroup(
                    group=task.id, reason=f"every member scored {rewards[0]}: no advantage (skip_uniform_groups)"
                ))  # fmt: skip
                continue
            advantages = self.algorithm.advantages(rewards)
            for member, advantage in zip(members, advantages, strict=True):
                samples.append(
                    TrainSample(
                        trajectory_id=member.trajectory_id,
                        group=task.id,
                        context=member.context,
                        advantage=advantage,
                        rollout=member,
                    )
                )
        return samples, dropped

    async def _train(self, iteration: int, samples: list[TrainSample]) -> TrainStepResult:
        base = self.state.checkpoint
        batch = {"samples": samples}
        if workflow.patched(SAMPLES_BY_REFERENCE):
            batch = {"batch": await self._store_samples(iteration, samples)}
        args = TrainStepArgs(
            run_id=self.input.run_id,
            iteration=iteration,
            model=self.input.model,
            base=base,
            **batch,
            settings=self.input.trainer,
            sampled_version=self.state.serving_version,
            weights_version=self.state.serving_version + 1,
            minibatch_seed=digest(self.input.seed, iteration, "minibatches"),
            base_republished=base is not None and base.weights_version != self.state.serving_version,
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

    async def _store_samples(self, iteration: int, samples: list[TrainSample]):
        """The batch stored in parts, an activity each, so no payload grows with the batch;
        one part at a time, since a workflow task that scheduled them all would send every
        part to the server in one message (at 10,000 samples over gRPC's 4 MB: Temporal
        terminated the run with GrpcMessageTooLarge)."""
        cut, refs = parts(samples), []
        for n, part in enumerate(cut):
            refs.append(
                await self._record_activity(
                    STORE_SAMPLES,
                    StoreSamplesArgs(run_id=self.input.run_id, iteration=iteration, samples=part),
                    summary=f"iteration {iteration}: store samples, part {n + 1} of {len(cut)}",
                )
            )
        return refs

    async def _publish(self, version: int, *, weights, summary: str, model: str | None = None) -> None:
        """Publish `version` to every node; all of them serve it before the run goes on."""
        args = PublishWeightsArgs(version=version, weights=weights, model=model)
        try:
            await publish_to_nodes(self.input.queues.nodes, args, summary)
        except PublishFailed as failure:
            raise RunFailure(str(failure)) from None

    def _record(
        self, iteration, tasks, groups, heldout, dropped, step: TrainStepResult, *, times
    ) -> IterationRecord:
        dropped_names = {d.group for d in dropped}
        complete = [
            (task, members)
            for task, members in zip(tasks, groups, strict=True)
            if all(m.status != "failed_infra" for m in members)
        ]
        uniform = {task.id for task, members in complete if _uniform([m.reward for m in members])}
        # A uniform group left out of the step was still rolled out and scored: it counts in
        # the reward, so a curve means the same with and without skip_uniform_groups.
        scored = dropped_names - uniform if self.input.skip_uniform_groups else dropped_names
        kept = [
            m.reward
            for task, members in zip(tasks, groups, strict=True)
            if task.id not in scored
            for m in members
        ]
        evaluated = [m.reward for m in heldout if m.reward is not None]
        rollout_s, train_s, publish_s, elapsed_s = times
        return IterationRecord(
            iteration=iteration,
            tasks=[t.id for t in tasks],
            rewards=[[m.reward for m in members] for members in groups],
            actions=[
                [None if m.status == "failed_infra" else m.turns for m in members] for members in groups
            ],
            mean_reward=sum(kept) / len(kept) if kept else None,
            heldout_reward=sum(evaluated) / len(evaluated) if evaluated else None,
            groups_kept=len(tasks) - len(dropped_names),
            groups_dropped=len(dropped_names),
            uniform_groups=len(uniform),
            dropped=dropped,
            infra_retries=sum(m.attempts - 1 for members in [*groups, heldout] for m in members),
            weights_version=step.checkpoint.weights_version,
            weights_sha256=step.weights_sha256,
            checkpoint=step.checkpoint,
            loss=step.loss,
            kl=step.kl,
            clip_fraction=step.clip_fraction,
            trained_tokens=step.trained_tokens,
            engine_logprob_drift=step.engine_logprob_drift,
            entropy=step.entropy,
            grad_norm=step.grad_norm,
            lr=step.lr,
            response_tokens=step.response_tokens,
            trainer_resumed_from=step.resumed_from,
            rollout_s=rollout_s,
            train_s=train_s,
            publish_s=publish_s,
            elapsed_s=elapsed_s,
            recovery_s=sum(m.recovery_s for members in [*groups, heldout] for m in members),
            tokens_after_recovery=sum(
                m.tokens_after_recovery for members in [*groups, heldout] for m in members
            ),
            recovered_tokens_differ=[
                m.trajectory_id
                for members in [*groups, heldout]
                for m in members
                if m.recovered_tokens_differ
            ],
            group_sandboxes=sorted(self.runner.group_records, key=lambda r: r.group),
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


def _uniform(rewards: list[float | None]) -> bool:
    """Every member scored the same: the group's advantages are all zero."""
    return len(set(rewards)) == 1
