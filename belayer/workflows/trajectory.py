"""`TrajectoryWorkflow`: the deterministic turn loop of one agent trajectory.

generate (rollout queue) -> action -> exec (the sandbox's host queue) -> observation
appended to the context -> next turn. A checkpoint chosen by the policy is captured beside
the next generation (the next action waits for that) and published beside that action
(`PendingCheckpoint`). Every sandbox call (an action, the reward
check, the workspace hash) goes through `_on_sandbox`: a lost sandbox is recovered from
the latest usable checkpoint with replay-verify, and a mismatch cuts the context
(`ContextCut`), from which the turn loop generates again, whatever phase it was in. Engine
failures never reach this code (the node takes over) or arrive as activity retries.
Every way out of the loop is a result: completed, failed_policy, or failed_infra with a
reason; `max_recoveries` bounds the recoveries, failed ones included. A sandbox the agent
broke itself is not recovered: the host says why each sandbox was lost, and a cause inside
it (its own OOM kill, PID 1 exiting by itself), or a loss with no cause found that the same
action brings about again after a restore, ends the trajectory failed_policy with reward 0
(`SandboxBroken`).

Workflow code only: no I/O, clocks or randomness outside Temporal's APIs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as TemporalTimeout

with workflow.unsafe.imports_passed_through():
    from belayer.contracts import sandbox
    from belayer.contracts.activity import Activity
    from belayer.contracts.context import (
        APPEND_OBSERVATION,
        FLUSH_LOG,
        FORK_CONTEXT,
        START_CONTEXT,
        AppendObservationArgs,
        ContextResult,
        FlushLogArgs,
        ForkContextArgs,
        StartContextArgs,
    )
    from belayer.contracts.errors import (
        ACTIVITY_NOT_REGISTERED,
        BAD_REQUEST,
        CAUSED_BY_AGENT,
        CORRUPT_PREFIX,
        HOST_REFUSED,
        LOST_UNEXPLAINED,
        NODE_FULL,
        PODMAN_FAILED,
        SANDBOX_LOST,
    )
    from belayer.contracts.generate import GENERATE, GenerateArgs, GenerateResult, SamplingParams
    from belayer.contracts.sandbox import (
        Action,
        CheckpointArgs,
        CheckpointRef,
        CreateSandboxArgs,
        DestroyArgs,
        ExecArgs,
        NextStageArgs,
        ObservationRef,
        PlaceArgs,
        PlaceResult,
        PublishArgs,
        RecoverArgs,
        SandboxHandle,
        VerifyArgs,
        VerifyResult,
        WorkspaceHashArgs,
    )
    from belayer.policy.adaptive import CheckpointSample, GenerationSample
    from belayer.storage.recordlog import RecordLogRef
    from belayer.trajectory_log import LogEntries, TrajectoryLogRef, steps_key
    from belayer.workflows.models import (
        ForkStart,
        RecoveredTurn,
        RecoveryRecord,
        SandboxBreak,
        StepRecord,
        TrajectoryInput,
        TrajectoryProgress,
        TrajectoryResult,
        TrajectoryState,
        TrajectoryStatus,
    )
    from belayer.workloads.drivers import TaskDriver, Verification
    from belayer.workloads.registry import driver_for

TASK_KEY = SearchAttributeKey.for_keyword("BelayerTask")
# A multi-step task's stage N runs its setup commands as steps N*1000+1... of the sandbox's
# setup journal (the create's are 1, 2...): a retried check never runs one twice.
SETUP_STEPS_PER_STAGE = 1000
STATUS_KEY = SearchAttributeKey.for_keyword("BelayerStatus")

# Sandbox failures that `recover` repairs (SANDBOX_LOST). Anything else from a sandbox is a
# bug or a hostile input and is reported, not papered over.
CHECKPOINTS_KEPT = 3

SANDBOX_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_attempts=3,
    non_retryable_error_types=sorted(SANDBOX_LOST),
)
ENGINE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=6)
STORAGE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)
HOST_SCHEDULE_TO_START = timedelta(seconds=30)
# create / recover on the shared queue: with no sandbox host at all, the trajectory ends.
SHARED_SCHEDULE_TO_START = timedelta(minutes=5)
AFFINITY_SCHEDULE_TO_START = timedelta(seconds=10)
# A node from before `LAST_APPEND_PATCH` does not have the append: the workflow's own
# worker appends at once instead of retrying it there.
NODE_APPEND_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_attempts=3,
    non_retryable_error_types=[ACTIVITY_NOT_REGISTERED],
)
# Both sides heartbeat about every second: a dead worker is noticed within these.
GENERATE_HEARTBEAT = timedelta(seconds=10)
SANDBOX_HEARTBEAT = timedelta(seconds=15)
SANDBOX_ACTIVITY_LIMIT = timedelta(minutes=10)
ACTION_LIMIT_MARGIN = timedelta(minutes=2)  # the host's own work around an action: install, collect
# Histories recorded before it carry no marker of this patch and replay as they ran: the
# observation appended by a context activity (on the context queue) after every action.
# With it, the observation rides with the next generation (`GenerateArgs.observation`) and
# the context activities that remain run locally.
OBSERVATION_WITH_GENERATION_PATCH = "observation-appended-with-generation"
# Histories recorded before it create and recover on the shared queue. With it, each first
# asks `sandbox.place` for the least loaded host with room (belayer/sandbox/placement.py)
# and goes there, or to the shared queue when none is named or that host refuses or is gone.
PLACEMENT_PATCH = "sandbox-placement"
# Histories recorded before it checkpoint in one activity, which the next action waits for.
# With it, a checkpoint is captured to a file on its host (the next action waits for that)
# and published to the store by a second activity beside the action
# (SandboxHost.capture_checkpoint says why).
STAGED_CHECKPOINT_PATCH = "checkpoint-published-beside-the-action"
# Histories recorded before it append an observation that nothing generates after in a local
# activity, and the last one before the final check. With it, the node that generated the
# last turn appends it when it takes the task in time (`_append_on_node` says why), and the
# final check runs beside the last append (`_judge`).
LAST_APPEND_PATCH = "last-append-on-the-node-beside-the-check"
# Histories recorded before it skip a decision while a checkpoint is being stored even at
# the unprotected-work bound. With it, a decision at the bound waits for that checkpoint
# and takes its own, so the bound holds.
BOUND_WAITS_FOR_STORING_PATCH = "bound-waits-for-a-checkpoint-being-stored"
# Histories recorded before it recover every lost sandbox. With it, a loss the host found
# the agent caused, or one with no cause found that the same action brings about again
# after a restore, ends the trajectory failed_policy (`_judge_loss`).
SANDBOX_BROKEN_BY_AGENT_PATCH = "sandbox-broken-by-its-agent-fails-the-policy"
# A placed host that is full or draining says so at once (HOST_REFUSED); placement is asked again.
PLACEMENT_TRIES = 3
ROOM_WAIT = timedelta(seconds=5)
# A turn every rollout node refused for want of room through the engine retries waits for
# room and is asked again, however long the nodes stay full: capacity is not a failure.
# Before it, the retries' end failed the trajectory failed_infra.
WAIT_FOR_NODE_ROOM_PATCH = "turns-wait-for-node-room"
PLACED_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_attempts=3,
    non_retryable_error_types=sorted(SANDBOX_LOST | HOST_REFUSED),
)


class InfraFailure(Exception):
    """The trajectory cannot continue for an infrastructure reason."""


class SandboxBroken(Exception):
    """What the agent ran brought its own sandbox down: the trajectory ends failed_policy."""

    def __init__(self, broken: SandboxBreak):
        super().__init__(broken.detail)
        self.broken = broken


class ContextCut(Exception):
    """A recovery found that the sandbox now answers step `record.step` differently: the
    state is cut back to that action; the turn loop records the new observation (in
    `record`) and generates again from there."""

    def __init__(self, record: StepRecord):
        super().__init__(f"context cut after step {record.step}")
        self.record = record


@dataclass
class PendingCheckpoint:
    """A checkpoint in flight beside the turn loop. Since `STAGED_CHECKPOINT_PATCH` it is
    captured while the next generation runs (the action waits for that) and published once
    the action starts: on a host whose cores the engine shares, compressing and uploading
    beside the generation would slow it, beside the action it costs the engine nothing."""

    step: int
    decision: int  # the policy's number for the decision that took it
    started: datetime
    staged: bool
    task: asyncio.Task | None = None
    captured: asyncio.Event = field(default_factory=asyncio.Event)
    action_started: asyncio.Event = field(default_factory=asyncio.Event)
    waited_s: float = 0.0  # what the action waited for the capture


@workflow.defn(name="TrajectoryWorkflow")
class TrajectoryWorkflow:
    @workflow.init
    def __init__(self, input: TrajectoryInput) -> None:
        self.input = input
        # What the loop asks of the task (instruction, turns, actions, check) is its kind's.
        self._driver: TaskDriver = driver_for(input.task)
        # What a graded check (a Harbor task's tests) found: its reward, values, logs, why none.
        self.verdict: VerifyResult | None = None
        self.state = input.carried or TrajectoryState(policy={"config": input.policy})
        self.status: TrajectoryStatus = "running"
        self.pending_checkpoint: PendingCheckpoint | None = None
        # The last action's observation, appended by the next generate (or flushed on its own
        # before anything else reads the context: the end, a recovery, continue-as-new).
        self.pending_observation: AppendObservationArgs | None = None
        self.first_step_of_run = self.state.step

    # ---------------------------------------------------------------- queries

    @workflow.query(name="progress")
    def progress(self) -> TrajectoryProgress:
        state = self.state
        return TrajectoryProgress(
            trajectory_id=self.input.trajectory_id,
            task=self.input.task.id,
            status=self.status,
            step=state.step,
            tokens=state.context.length if state.context else 0,
            checkpoints_taken=state.policy.checkpointed,
            latest_checkpoint_step=state.checkpoints[0].step if state.checkpoints else None,
            recoveries=state.recoveries,
            decisions=state.policy.decided,
            recent_decisions=state.policy.decisions,
            predictor_error=state.policy.predictor_error(),
            sandbox=state.sandbox,
            node_queue=state.node_queue,
        )

    # ---------------------------------------------------------------- main loop

    @workflow.run
    async def run(self, input: TrajectoryInput) -> TrajectoryResult:
        self._set_status("running")
        try:
            if self.state.sandbox is None:
                await self._start()
            while True:
                try:
                    if self.state.sandbox_pending:
                        reason, self.state.sandbox_pending = self.state.sandbox_pending, None
                        await self._recover(reason, kind="fork")
                    return await self._turns_then_finish()
                except ContextCut as cut:
                    await self._record_step(cut.record)
        except (InfraFailure, SandboxLost) as failure:
            return await self._fail_infra(str(failure))
        except SandboxBroken as broken:
            return await self._fail_policy(broken.broken)

    async def _turns_then_finish(self) -> TrajectoryResult:
        """The turn loop (of each stage, for a multi-step task) and the final check; a cut
        anywhere in it leaves by `ContextCut`."""
        while True:
            while not self._finished():
                if self._should_continue_as_new():
                    await self._settle_checkpoint()
                    await self._flush_observation()
                    self._continue_as_new()
                await self._turn()
            await self._settle_checkpoint()
            if not await self._next_stage():
                return await self._finish()

    async def _start(self) -> None:
        start = self.input.start_from
        if start is not None and start.at_step is not None:
            return await self._start_branch(start)
        await self._start_sandbox(start)
        started = await self._open_context(start)
        self.state.context = started.prefix
        self.state.log = TrajectoryLogRef(
            trajectory_id=self.input.trajectory_id,
            steps=RecordLogRef(key=self._steps_key(), length=0),
        )

    async def _start_sandbox(self, start: ForkStart | None) -> None:
        """A group member's fork, else a new sandbox."""
        if start is not None and start.sandbox is not None:
            self.state.sandbox = start.sandbox
            self.state.checkpoints = list(start.checkpoints)
        else:
            self.state.sandbox = await self._create_sandbox()

    async def _open_context(self, start: ForkStart | None) -> ContextResult:
        """The token log: a fork of the group's prompt for a member, else the task's prompt."""
        if start is not None:
            return await self._context_activity(
                FORK_CONTEXT,
                ForkContextArgs(
                    log_key=self._log_key(),
                    trajectory_id=self.input.trajectory_id,
                    steps_key=self._steps_key(),
                    prefix=start.prompt,
                ),
                summary=f"fork the token log of group {start.parent}'s prompt",
            )
        return await self._context_activity(
            START_CONTEXT,
            StartContextArgs(
                log_key=self._log_key(),
                trajectory_id=self.input.trajectory_id,
                steps_key=self._steps_key(),
                instruction=self._driver.instruction(self.input.task),
            ),
            summary="tokenize the prompt into a new token log",
        )

    async def _create_sandbox(self):
        task = self.input.task
        # A sandbox id chosen here (deterministically) makes a retried create replace its
        # own earlier attempt instead of leaking a second container.
        sandbox_id = f"sbx-{workflow.uuid4().hex[:12]}"
        try:
            created = await self._on_placed_host(
                sandbox.CREATE,
                CreateSandboxArgs(sandbox_id=sandbox_id, spec=self._driver.sandbox(task)),
                key=sandbox_id,
                summary=f"create sandbox for {task.id} ({len(task.setup)} setup commands)",
            )
        except SandboxLost as lost:
            raise InfraFailure(f"{sandbox.CREATE.name} failed: {lost.reason}") from None
        return created.handle

    async def _start_branch(self, start: ForkStart) -> None:
        """Continue `start.parent` after its step K: its context up to the action of step K
        (a forked token log), step K's logged observation appended as the parent's was, its
        steps 1..K inherited; the sandbox comes from the parent's latest usable checkpoint
        at or before K with replay-verify up to K (`sandbox_pending`, before the first turn),
        and a mismatch cuts the context like any recovery. Sampling seeds continue where
        the parent's were (one generation per step), so the parent's seed replays its turns.
        Within a multi-step task's later stage the branch continues that stage: its
        boundary and the earlier stages' checks are the parent's, and no restore or replay
        goes behind the boundary."""
        at = start.at_step
        forked = await self._context_activity(
            FORK_CONTEXT,
            ForkContextArgs(
                log_key=self._log_key(),
                trajectory_id=self.input.trajectory_id,
                steps_key=self._steps_key(),
                prefix=at.context_after_action,
                steps_from=RecordLogRef(key=start.steps.key, length=at.step - 1),
            ),
            summary=f"fork {start.parent}'s token and step logs at step {at.step}",
        )
        self.state.step = self.state.generations = at.step
        self.state.stage, self.state.stage_start = at.stage, start.stage_start
        self.state.stage_checks = list(start.stage_checks)
        self.state.context = forked.prefix
        self.state.log = TrajectoryLogRef(
            trajectory_id=self.input.trajectory_id,
            steps=RecordLogRef(key=self._steps_key(), length=at.step - 1),
        )
        self.state.checkpoints = list(start.checkpoints)
        # Not started yet: `recover` restores a checkpoint of another lineage as a fork with
        # this id, or creates it and replays from the start.
        self.state.sandbox = SandboxHandle(
            sandbox_id=f"sbx-{workflow.uuid4().hex[:12]}",
            host_queue=self.input.queues.sandbox,
            generation=0,
            container="",
        )
        self.state.sandbox_pending = f"branch of {start.parent} after step {at.step}"
        await self._append_observation(at)

    def _finished(self) -> bool:
        state = self.state
        if state.stopped:
            return True
        if state.context and state.context.length >= self.input.max_total_tokens:
            return True
        return state.step - state.stage_start >= self._driver.turn_limit(self.input.task)

    async def _turn(self) -> None:
        generation = await self._generate()
        await self._wait_for_capture()
        if generation is None:
            return  # the observation filled the context: the loop ends without a turn
        command = self._action_from(generation)
        if command is None:
            self.state.stopped = True
            return
        self.state.step += 1
        action = Action(trajectory=self.input.trajectory_id, step=self.state.step, command=command,
                        timeout_s=self._driver.action_timeout_s(self.input.task, self.state.stage))  # fmt: skip
        executed = await self._on_sandbox(
            sandbox.EXEC,
            lambda handle: ExecArgs(handle=handle, action=action),
            summary=f"step {action.step}: {first_line(command)}",
        )
        await self._record_step(
            StepRecord(
                step=action.step,
                command=command,
                observation=executed.observation,
                context_after_action=generation.prefix,
                stage=self.state.stage,
            )
        )

    async def _record_step(self, record: StepRecord) -> None:
        """Log an executed step (or the step a cut rewrote) and append its observation."""
        self.state.policy.observe_action(record.observation.duration_s)
        self._maybe_checkpoint(
            record.context_after_action, storing_step=await self._checkpoint_still_storing()
        )
        await self._append_observation(record)

    def _action_from(self, generation: GenerateResult) -> str | None:
        return self._driver.next_action(self.input.task, self.state.step, generation.text)

    # ---------------------------------------------------------------- generation

    async def _generate(self) -> GenerateResult | None:
        """The next turn, after the pending observation (appended by the same activity);
        None when that observation left no room in the context for a turn."""
        turn = self._driver.sampling(self.input.task, self.state.step)
        budget = self.input.max_total_tokens - self.state.context.length
        observation, self.pending_observation = self.pending_observation, None
        args = GenerateArgs(
            prefix=self.state.context,
            observation=observation,
            max_context=self.input.max_total_tokens if observation is not None else None,
            sampling=SamplingParams(
                max_tokens=max(1, min(turn.max_tokens, budget)),
                temperature=self.input.sampling.temperature,
                seed=self.input.sampling.seed + self.state.generations,
                ignore_eos=turn.ignore_eos,
            ),
        )
        try:
            result = await self._generate_with_affinity(args)
        except InfraFailure:
            self.pending_observation = observation  # for the log the failure still writes
            raise
        self.state.context = result.prefix
        if observation is not None:
            self._observation_written(observation)
            if result.output_tokens == 0 and result.prefix.length >= self.input.max_total_tokens:
                return None
        self._generated(result)
        return result

    def _generated(self, result: GenerateResult) -> None:
        """A turn's generation counted: its seed used, its node, what recovery changed, its timing."""
        self.state.generations += 1
        self.state.node_queue = result.node_queue
        self._count_tokens_after_recovery(result)
        self.state.policy.observe_generation(
            GenerationSample(
                output_tokens=result.output_tokens,
                per_token_s=result.timing.per_token_s,
                queue_s=result.timing.queue_s,
                total_s=result.timing.total_s,
            )
        )

    def _count_tokens_after_recovery(self, result: GenerateResult) -> None:
        """Every token from the first engine recovery on is one a near-tie may have flipped
        (README, determinism contract): count them, and keep each recovered turn's replay."""
        if result.recovery_replay is not None:
            self.state.recovered_turns.append(
                RecoveredTurn(turn=self.state.step + 1, replay=result.recovery_replay)
            )
            self.state.tokens_after_recovery += result.recovery_replay.tokens_after
        elif self.state.recovered_turns:
            self.state.tokens_after_recovery += result.output_tokens

    async def _generate_with_affinity(self, args: GenerateArgs) -> GenerateResult:
        """Prefer the node that served the previous turn (its prefix cache holds this
        context); when it does not pick the turn up in time, or refuses it for want of
        room, any node takes it, and while every node is full the turn waits for room."""
        summary = f"turn {self.state.step + 1}: generate up to {args.sampling.max_tokens} tokens"
        if self.state.node_queue:
            try:
                return await GENERATE.execute(
                    args,
                    task_queue=self.state.node_queue,
                    schedule_to_start_timeout=AFFINITY_SCHEDULE_TO_START,
                    start_to_close_timeout=timedelta(minutes=30),
                    heartbeat_timeout=GENERATE_HEARTBEAT,
                    retry_policy=ENGINE_RETRY,
                    summary=summary + f" on {self.state.node_queue}",
                )
            except ActivityError as err:
                if _error_type(err) in (BAD_REQUEST, CORRUPT_PREFIX):
                    raise InfraFailure(f"generation refused: {_cause(err)}") from None
                self.state.node_queue = None  # that node is gone or stuck: any node will do
        while True:
            try:
                return await GENERATE.execute(
                    args,
                    task_queue=self.input.queues.rollout,
                    start_to_close_timeout=timedelta(minutes=30),
                    heartbeat_timeout=GENERATE_HEARTBEAT,
                    retry_policy=ENGINE_RETRY,
                    summary=summary,
                )
            except ActivityError as err:
                if _error_type(err) == NODE_FULL and workflow.patched(WAIT_FOR_NODE_ROOM_PATCH):
                    await workflow.sleep(ROOM_WAIT)
                    continue
                raise InfraFailure(f"generation failed after retries: {_cause(err)}") from None

    # ---------------------------------------------------------------- actions and recovery

    async def _on_sandbox(self, activity: Activity, make_args, *, summary, before_recovery=None):
        """Call the sandbox that holds the trajectory; when it is lost, recover it and call
        again. A recovery that cuts the context raises `ContextCut` out of here, for the turn
        loop to resume from: actions, the reward check and the hash all go this one way.
        `before_recovery`, when given, is waited for before any recovery starts. A sandbox
        the agent broke is not recovered (`_judge_loss`), whatever phase it was in: the
        check is run again only after a loss from outside."""
        while True:
            try:
                result = await self._sandbox_activity(
                    activity,
                    make_args(self.state.sandbox),
                    queue=self.state.sandbox.host_queue,
                    on_host=True,
                    summary=summary,
                )
            except SandboxLost as lost:
                self._judge_loss(lost)
                if before_recovery is not None:
                    await before_recovery
                await self._recover(lost.reason)
                continue
            self.state.unexplained_loss_step = None
            return result

    def _judge_loss(self, lost: SandboxLost) -> None:
        """Raise `SandboxBroken` when the agent is to blame for losing the sandbox: the host
        found the cause inside it (errors.CAUSED_BY_AGENT), or found none and the same step
        lost the sandbox last time too, after a restore. A loss from outside, or one nobody
        looked into (a host that timed out, one from before the host said why), is
        infrastructure and recovered."""
        step = lost.step if lost.step is not None else self.state.step
        if lost.cause in CAUSED_BY_AGENT and workflow.patched(SANDBOX_BROKEN_BY_AGENT_PATCH):
            raise SandboxBroken(SandboxBreak(step=step, cause=lost.cause, detail=lost.detail))
        if lost.cause != LOST_UNEXPLAINED:
            return
        if self.state.unexplained_loss_step == step and workflow.patched(SANDBOX_BROKEN_BY_AGENT_PATCH):
            raise SandboxBroken(
                SandboxBreak(
                    step=step,
                    cause="reproduced",
                    detail=f"the same action lost the sandbox again after a restore, no cause outside it: {lost.detail}",
                )
            )
        self.state.unexplained_loss_step = step

    async def _recover(self, reason: str, kind: str = "sandbox") -> None:
        """Restore the sandbox and replay-verify; raises `ContextCut` on a mismatch and
        `InfraFailure` when recovery is impossible or `max_recoveries` is spent. A recover
        whose new sandbox is lost too counts as one recovery, and is tried again. The
        pending observation goes to the logs first: replay-verify reads the step log."""
        await self._flush_observation()
        await self._settle_checkpoint()
        while True:
            if len(self.state.recoveries) >= self.input.max_recoveries:
                raise InfraFailure(
                    f"sandbox lost again after {self.input.max_recoveries} recoveries: {reason}"
                )
            started = workflow.now()
            try:
                result = await self._on_placed_host(
                    sandbox.RECOVER,
                    self._recover_args(),
                    key=self.state.sandbox.sandbox_id,
                    avoid=[self.state.sandbox.host_queue],
                    summary=f"recover sandbox at step {self.state.step}: {reason[:80]}",
                )
            except (SandboxLost, InfraFailure) as failed:
                self.state.recoveries.append(
                    RecoveryRecord(
                        kind=kind,
                        step=self.state.step,
                        reason=reason,
                        source="failed",
                        failed=True,
                        replayed_steps=0,
                        consistent=False,
                        notes=[str(failed)],
                        time_lost_s=(workflow.now() - started).total_seconds(),
                    )
                )
                if isinstance(failed, InfraFailure):
                    raise InfraFailure(f"recovery failed: {failed}") from None
                self._judge_loss(failed)  # a replayed action of the agent's broke the new sandbox
                reason = f"recovery failed: {failed}"
                continue
            break
        outcome = result.outcome
        self.state.sandbox = outcome.handle
        drained = outcome.drained_checkpoint
        if drained is not None and drained not in self.state.checkpoints:
            # The drain's checkpoint is this sandbox's newest: a second loss starts from it too.
            self.state.checkpoints = [drained, *self.state.checkpoints][:CHECKPOINTS_KEPT]
        record = RecoveryRecord(
            kind=kind,
            step=self.state.step,
            reason=reason,
            source=outcome.source,
            replayed_steps=outcome.replayed_steps,
            consistent=outcome.consistent,
            notes=outcome.notes,
            time_lost_s=(workflow.now() - started).total_seconds(),
        )
        self.state.recoveries.append(record)
        if result.mismatch_step is not None and result.mismatch_observation is not None:
            raise ContextCut(self._cut_context(result.mismatch_step, result.mismatch_observation, record))

    def _recover_args(self) -> RecoverArgs:
        """The host reads the step log itself (commands, observation hashes, the context
        after each action) and replays and verifies from it."""
        return RecoverArgs(
            handle=self.state.sandbox,
            trajectory_id=self.input.trajectory_id,
            checkpoints=self.state.checkpoints,
            steps=self.state.log.steps,
            spec=self._driver.sandbox(self.input.task),
            earliest_step=self.state.stage_start,
        )

    def _cut_context(self, at: StepRecord, observation: ObservationRef, record: RecoveryRecord) -> StepRecord:
        """Cut after action `at.step`: its new observation replaces the logged one, later
        steps go (the next append starts a new branch of the token and step logs)."""
        record.cut_after_step = at.step
        self.state.unexplained_loss_step = None  # a new branch: its actions are new ones
        record.tokens_discarded = self.state.context.length - at.context_after_action.length
        # Checkpoints from step `at.step` on hold the future the cut discards.
        self.state.checkpoints = [c for c in self.state.checkpoints if c.step < at.step]
        self.state.step = at.step
        self.state.stopped = False  # the model has not seen the new observation: it goes on
        self.state.context = at.context_after_action
        self.state.log_generation += 1
        return at.model_copy(update={"observation": observation})

    # ---------------------------------------------------------------- checkpoints

    def _maybe_checkpoint(self, context, storing_step: int | None = None) -> None:
        sandbox_mb = self.state.checkpoints[0].archive_bytes / 2**20 if self.state.checkpoints else 0.0
        next_tokens = self._expected_next_output()
        decision = self.state.policy.decide(
            self.state.step, sandbox_mb, next_tokens, storing_step=storing_step
        )
        if not decision.checkpointed:
            return
        args = CheckpointArgs(
            handle=self.state.sandbox,
            token_prefix_len=context.length,
            token_prefix_sha256=context.sha256,
        )
        pending = PendingCheckpoint(step=self.state.step, decision=self.state.policy.decided, started=workflow.now(),
                                    staged=workflow.patched(STAGED_CHECKPOINT_PATCH))  # fmt: skip
        pending.task = asyncio.ensure_future(self._checkpoint(args, pending))
        self.pending_checkpoint = pending

    async def _checkpoint(self, args: CheckpointArgs,
                          pending: PendingCheckpoint) -> tuple[CheckpointRef, float, float | None]:  # fmt: skip
        """The checkpoint, the seconds it worked and of them the capture's: one activity (no
        capture of its own), or a capture and then, once the next action starts, a publish
        (the wait between them is not its work)."""
        queue, step = args.handle.host_queue, pending.step
        if not pending.staged:
            result = await self._sandbox_activity(
                sandbox.CHECKPOINT, args, queue=queue, on_host=True, summary=f"checkpoint after step {step}"
            )
            return result.checkpoint, (workflow.now() - pending.started).total_seconds(), None
        try:
            capture = await self._sandbox_activity(
                sandbox.CAPTURE_CHECKPOINT,
                args,
                queue=queue,
                on_host=True,
                summary=f"capture a checkpoint after step {step}",
            )
        finally:
            pending.captured.set()
        capture_s = (workflow.now() - pending.started).total_seconds()
        await pending.action_started.wait()
        publish_started = workflow.now()
        result = await self._sandbox_activity(
            sandbox.PUBLISH_CHECKPOINT,
            PublishArgs(staged=capture.staged),
            queue=queue,
            on_host=True,
            summary=f"publish the checkpoint after step {step}",
        )
        return result.checkpoint, capture_s + (workflow.now() - publish_started).total_seconds(), capture_s

    async def _wait_for_capture(self) -> None:
        """Before an action: the checkpoint in flight must have captured the sandbox, and
        its publish starts now, beside the action. One from before the patch is waited for whole."""
        pending = self.pending_checkpoint
        if pending is None:
            return
        if not pending.staged:
            return await self._settle_checkpoint()
        waited_from = workflow.now()
        await pending.captured.wait()
        pending.waited_s += (workflow.now() - waited_from).total_seconds()
        pending.action_started.set()
        if pending.task.done():
            await self._settle_checkpoint()

    async def _checkpoint_still_storing(self) -> int | None:
        """After an action: the step of a checkpoint whose publish is still running, which
        an adaptive decision skips past instead of waiting for, unless the unprotected work
        has reached its bound; otherwise the checkpoint in flight is settled (waited for,
        if it must be) and None."""
        pending = self.pending_checkpoint
        if pending is None:
            return None
        if pending.staged and not pending.task.done() and self._skips_past_storing():
            return pending.step
        await self._settle_checkpoint()
        return None

    def _skips_past_storing(self) -> bool:
        policy = self.state.policy
        if policy.skips_past_storing():
            return True
        # Histories from before the patch skipped at the bound too.
        return policy.config.mode == "adaptive" and not workflow.patched(BOUND_WAITS_FOR_STORING_PATCH)

    async def _settle_checkpoint(self) -> None:
        """Wait for the checkpoint in flight (if any) and account for it."""
        pending, self.pending_checkpoint = self.pending_checkpoint, None
        if pending is None:
            return
        pending.action_started.set()  # whatever comes next, the publish need not wait for it
        waited_from = workflow.now()
        try:
            checkpoint, duration, capture_s = await pending.task
        except (SandboxLost, InfraFailure, ActivityError):
            self.state.policy.observe_checkpoint_failed(pending.decision)
            return
        wait = pending.waited_s + (workflow.now() - waited_from).total_seconds()
        self.state.checkpoints = [checkpoint, *self.state.checkpoints][:CHECKPOINTS_KEPT]
        self.state.policy.observe_checkpoint(
            CheckpointSample(
                duration_s=duration, size_mb=checkpoint.archive_bytes / 2**20, capture_s=capture_s
            ),
            wait_s=wait,
            decision=pending.decision,
        )

    def _expected_next_output(self) -> int | None:
        """Tokens of the coming generation when the task says (a trace); 0 after its last
        turn, where no generation follows to hide a checkpoint in. None, the policy predicts
        from history: on a model task, or a trace whose lengths the policy is not to know."""
        if not self.state.policy.config.trace_lengths_known:
            return None
        return self._driver.expected_output_tokens(self.input.task, self.state.step)

    # ---------------------------------------------------------------- context

    async def _append_observation(self, record: StepRecord) -> None:
        """Have the step's stored observation appended to the context and the step, the
        completed decisions and any new recoveries recorded in the trajectory's log: by the
        next generate, or by a context activity now in histories from before that. After a
        cut, both logs start a new branch from what the cut keeps."""
        log = self.state.log
        fork_to, steps_fork_from = None, None
        if self.state.context.key != self._log_key():
            fork_to = self._log_key()
        if log.steps.key != self._steps_key():
            steps_fork_from = RecordLogRef(key=log.steps.key, length=record.step - 1)
        self.pending_observation = AppendObservationArgs(
            trajectory_id=self.input.trajectory_id,
            prefix=self.state.context,
            step=record,
            steps_key=self._steps_key(),
            fork_to=fork_to,
            steps_fork_from=steps_fork_from,
            entries=self._unwritten_entries(keep_latest_decision=True),
        )
        if not self._observation_with_generation():
            await self._flush_observation()

    async def _flush_observation(self) -> None:
        """Append the pending observation on its own (nothing generates after it now)."""
        if self.pending_observation is None:
            return
        args, self.pending_observation = self.pending_observation, None
        summary = f"step {args.step.step}: append observation (exit {args.step.observation.exit_code})"
        result = await self._append_on_node(args, summary) if workflow.patched(LAST_APPEND_PATCH) else None
        if result is None:
            result = await self._context_activity(APPEND_OBSERVATION, args, summary=summary)
        self.state.context = result.prefix
        self._observation_written(args)

    async def _append_on_node(self, args: AppendObservationArgs, summary: str) -> ContextResult | None:
        """The append, by the node that generated the last turn: that process wrote the token
        log's head and goes on from it, where this worker reads back every segment since
        the prompt (O(turns) requests: ~60 ms after 10 turns on the dev machine). None when
        no node served this run yet, or it does not take the task in time or fails it:
        the context activity then appends (each write is idempotent)."""
        if not self.state.node_queue:
            return None
        try:
            return await APPEND_OBSERVATION.execute(
                args,
                task_queue=self.state.node_queue,
                schedule_to_start_timeout=AFFINITY_SCHEDULE_TO_START,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=NODE_APPEND_RETRY,
                summary=f"{summary} on {self.state.node_queue}",
            )
        except ActivityError:
            return None

    def _observation_written(self, args: AppendObservationArgs) -> None:
        self._entries_written(args.entries, steps=RecordLogRef(key=args.steps_key, length=args.step.step))

    def _observation_with_generation(self) -> bool:
        return workflow.patched(OBSERVATION_WITH_GENERATION_PATCH)

    def _unwritten_entries(self, *, keep_latest_decision: bool) -> LogEntries:
        """Decisions and recoveries not in the log yet. The latest decision is complete only
        once the next generation and its checkpoint are over: it waits unless the end came."""
        log, policy = self.state.log, self.state.policy
        done = policy.decided - 1 if keep_latest_decision else policy.decided
        if self.pending_checkpoint is not None:  # its decision is complete once it is stored
            done = min(done, self.pending_checkpoint.decision - 1)
        decisions = [
            d for n, d in enumerate(policy.decisions, policy.first_held) if log.decisions < n <= done
        ]
        return LogEntries(
            decisions_from=log.decisions + 1,
            decisions=decisions,
            recoveries_from=log.recoveries + 1,
            recoveries=self.state.recoveries[log.recoveries :],
        )

    def _entries_written(self, entries: LogEntries, *, steps: RecordLogRef | None = None) -> None:
        log = self.state.log
        self.state.log = log.model_copy(
            update={
                "steps": steps or log.steps,
                "decisions": log.decisions + len(entries.decisions),
                "recoveries": log.recoveries + len(entries.recoveries),
            }
        )
        self.state.policy.forget_decisions(self.state.log.decisions)

    async def _flush_log(self) -> None:
        """The end: whatever the last step left unwritten goes to the log."""
        if self.state.log is None:
            return
        entries = self._unwritten_entries(keep_latest_decision=False)
        if entries.decisions or entries.recoveries:
            await self._context_activity(
                FLUSH_LOG,
                FlushLogArgs(trajectory_id=self.input.trajectory_id, entries=entries),
                summary="write the last decisions and recoveries to the trajectory's log",
            )
            self._entries_written(entries)

    def _log_key(self) -> str:
        return f"trajectories/{self.input.trajectory_id}/tokens/v{self.state.log_generation}"

    def _steps_key(self) -> str:
        return steps_key(self.input.trajectory_id, self.state.log_generation)

    # ---------------------------------------------------------------- the end

    async def _finish(self) -> TrajectoryResult:
        reward, exhausted = await self._judge()
        env_hash = await self._workspace_hash()
        await self._destroy()
        await self._flush_log()
        status: TrajectoryStatus = "completed" if reward == 1.0 else "failed_policy"
        reason = exhausted or ""
        if self.verdict is not None and not exhausted:  # graded: any reward it wrote completes it
            status = "completed" if self.verdict.reward is not None else "failed_policy"
            reason = self.verdict.reason
        self._set_status(status)
        return self._result(status, reward=reward, env_sha256=env_hash, reason=reason)

    async def _judge(self) -> tuple[float, str | None]:
        """The reward, and why the context budget ended the trajectory if it did.

        Since `LAST_APPEND_PATCH` the check runs beside the last observation's append: the
        check reads the sandbox, not the context, so the end need not wait for one and then
        the other. A recovery during the check waits for the append first, as it reads and
        may cut the context. An observation that fills the budget still makes the reward 0:
        the budget is judged once both are done."""
        if (not workflow.patched(LAST_APPEND_PATCH) or self.pending_observation is None
                or self._budget_exhausted()):  # fmt: skip
            await self._flush_observation()
            exhausted = self._budget_exhausted()
            return (0.0 if exhausted else await self._reward()), exhausted
        appending = asyncio.ensure_future(self._flush_observation())
        try:
            checked = await self._reward(before_recovery=appending)
        finally:
            await asyncio.gather(appending, return_exceptions=True)  # the log keeps the last step
        await appending  # its failure, now the check is over
        exhausted = self._budget_exhausted()
        return (0.0 if exhausted else checked), exhausted

    def _budget_exhausted(self) -> str | None:
        """Why the context budget ended the trajectory before its task did, if it did."""
        used, budget = self.state.context.length, self.input.max_total_tokens
        if self.state.stopped or used < budget:
            return None
        if self.state.step == 0:
            return (
                f"context budget exhausted before the first turn: the prompt alone is {used} tokens, "
                f"the budget {budget} (max_total_tokens; rollout.max_model_len)"
            )
        return f"context budget exhausted after {self.state.step} turns: {used} of {budget} tokens"

    async def _reward(self, before_recovery: asyncio.Future | None = None) -> float:
        verification = self._driver.verification(self.input.task, self.state.stage)
        if verification is None:
            return 1.0
        # The check is the trajectory's last action, run apart from the agent's shell (it
        # judges the agent, it must not inherit its state); the journal makes a retried
        # check return the same verdict.
        action = Action(
            trajectory=self.input.trajectory_id, step=self.state.step + 1, command=verification.command
        )
        if verification.graded is not None:
            return await self._graded_reward(action, verification, before_recovery)
        executed = await self._on_sandbox(
            sandbox.EXEC,
            lambda handle: ExecArgs(
                handle=handle, action=action, isolated=True, processes=verification.processes
            ),
            summary=f"check: {first_line(verification.command)}",
            before_recovery=before_recovery,
        )
        return 1.0 if executed.observation.exit_code == 0 else 0.0

    async def _graded_reward(self, action: Action, verification: Verification,
                             before_recovery: asyncio.Future | None) -> float:  # fmt: skip
        """A check that writes its own reward (a Harbor task's tests): any value it wrote is
        the reward; none (a timeout, no reward file) is 0, and the trajectory the agent's
        failure with the reason (`_finish`)."""
        checks = list(self.state.stage_checks)
        if not self.state.stopped_early:  # else the stage that stopped it was the last checked
            graded = verification.graded
            action = action.model_copy(update={"timeout_s": graded.timeout_s})
            checks.append(await self._on_sandbox(
                sandbox.VERIFY,
                lambda handle: VerifyArgs(handle=handle, action=action, tests=graded.tests,
                                          processes=verification.processes, reward_key=graded.reward_key,
                                          artifacts=list(graded.artifacts)),
                summary=f"verify: {first_line(verification.command.splitlines()[-1])}",
                before_recovery=before_recovery,
            ))  # fmt: skip
        self.verdict = self._staged(checks)
        return self.verdict.reward if self.verdict.reward is not None else 0.0

    def _staged(self, checks: list[VerifyResult]) -> VerifyResult:
        """The task's verdict from its stages' checks: the last one's, with the reward the
        task's driver makes of them all (a stage not run counts 0) and each stage's reward
        kept (`step1`, `step2`...); no reward when the last check wrote none."""
        last = checks[-1]
        if len(checks) == 1 and self._driver.stages(self.input.task) == 1:
            return last
        per_stage = {f"step{n}": check.reward or 0.0 for n, check in enumerate(checks, start=1)}
        reward = None if last.reward is None else self._driver.staged_reward(
            self.input.task, [check.reward for check in checks])  # fmt: skip
        artifacts = {path: key for check in checks for path, key in check.artifacts.items()}
        return last.model_copy(update={"reward": reward, "rewards": {**last.rewards, **per_stage},
                                       "artifacts": artifacts})  # fmt: skip

    async def _next_stage(self) -> bool:
        """A multi-step task's stage boundary: the stage's check, and when it scored at least
        its minimum, the next stage begun (its files and setup, by the same activity) and
        told to the agent as the check's step's observation; then a checkpoint, awaited,
        which every later recovery starts from or after (no replay crosses the boundary:
        the check and the files are in no action). False when there is no next stage."""
        state, task = self.state, self.input.task
        if state.stage + 1 >= self._driver.stages(task) or state.stopped_early or self._budget_exhausted():
            return False
        await self._flush_observation()
        verification = self._driver.verification(task, state.stage)
        coming = self._driver.next_stage(task, state.stage + 1)
        action = Action(trajectory=self.input.trajectory_id, step=state.step + 1, command=verification.command,
                        timeout_s=verification.graded.timeout_s)  # fmt: skip
        begin = NextStageArgs(
            uploads=coming.uploads, setup_commands=list(coming.setup_commands), min_reward=coming.min_reward,
            first_setup_step=SETUP_STEPS_PER_STAGE * (state.stage + 1) + 1,
            message=f"The tests of this step have run. Next step ({state.stage + 2} of "
                    f"{self._driver.stages(task)}, {coming.name}):\n\n{coming.instruction}",
        )  # fmt: skip
        checked = await self._on_sandbox(
            sandbox.VERIFY,
            lambda handle: VerifyArgs(handle=handle, action=action, tests=verification.graded.tests,
                                      processes=verification.processes,
                                      reward_key=verification.graded.reward_key,
                                      artifacts=list(verification.graded.artifacts), next_stage=begin),
            summary=f"verify step {state.stage + 1}, then begin {coming.name}",
        )  # fmt: skip
        state.stage_checks.append(checked)
        if checked.next_observation is None:
            state.stopped_early = True
            return False
        state.step, state.stage, state.stage_start, state.stopped = (
            action.step,
            state.stage + 1,
            action.step,
            False,
        )
        record = StepRecord(step=action.step, command=f": step {coming.name} begins", stage=state.stage,
                            observation=checked.next_observation, context_after_action=state.context)  # fmt: skip
        await self._append_observation(record)
        boundary = await self._on_sandbox(
            sandbox.CHECKPOINT,
            lambda handle: CheckpointArgs(handle=handle, token_prefix_len=state.context.length,
                                          token_prefix_sha256=state.context.sha256),
            summary=f"checkpoint as step {coming.name} begins",
        )  # fmt: skip
        state.checkpoints = [boundary.checkpoint]
        return True

    async def _workspace_hash(self) -> str:
        spec = self._driver.sandbox(self.input.task)
        path = {"path": spec.semantics.workdir} if spec.semantics is not None else {}
        hashed = await self._on_sandbox(
            sandbox.WORKSPACE_HASH,
            lambda handle: WorkspaceHashArgs(handle=handle, **path),
            summary="hash /workspace",
        )
        return hashed.sha256

    async def _destroy(self) -> None:
        if self.state.sandbox is None:
            return
        try:
            await self._sandbox_activity(
                sandbox.DESTROY,
                DestroyArgs(handle=self.state.sandbox, delete_checkpoints=not self.input.keep_checkpoints),
                queue=self.state.sandbox.host_queue,
                on_host=True,
                summary="destroy sandbox",
            )
        except (SandboxLost, InfraFailure):
            pass  # the sandbox is gone already; its checkpoints expire with the bucket's lifecycle

    async def _fail_infra(self, reason: str) -> TrajectoryResult:
        await self._abandon()
        self._set_status("failed_infra")
        return self._result("failed_infra", reason=reason, reward=None, env_sha256=None)

    async def _fail_policy(self, broken: SandboxBreak) -> TrajectoryResult:
        """The agent broke its own sandbox: reward 0, as for any task it failed."""
        await self._abandon()
        self._set_status("failed_policy")
        return self._result("failed_policy", reward=0.0, env_sha256=None, sandbox_broken=broken,
                            reason=f"the agent broke its sandbox at step {broken.step} ({broken.cause}): "
                                   f"{broken.detail}")  # fmt: skip

    async def _abandon(self) -> None:
        """An end before the check: the checkpoint in flight dropped, the sandbox destroyed,
        the last observation and log entries written where that still works."""
        if self.pending_checkpoint is not None:
            self.pending_checkpoint.task.cancel()
            self.pending_checkpoint = None
        await self._destroy()
        try:
            await self._flush_observation()
            await self._flush_log()
        except InfraFailure:
            pass  # the result still carries the recoveries; the log misses the last few

    def _result(self, status: TrajectoryStatus, *, reward, env_sha256, reason: str = "",
                sandbox_broken: SandboxBreak | None = None) -> TrajectoryResult:  # fmt: skip
        state = self.state
        return TrajectoryResult(
            trajectory_id=self.input.trajectory_id,
            task=self.input.task.id,
            status=status,
            reason=reason,
            turns=state.step - sum(check.next_observation is not None for check in state.stage_checks),
            tokens=state.context.length if state.context else 0,
            reward=reward,
            token_sha256=state.context.sha256 if state.context else None,
            context=state.context,
            env_sha256=env_sha256,
            recoveries=state.recoveries,
            checkpoints=state.policy.checkpointed,
            log=state.log,
            sandbox_broken=sandbox_broken,
            rewards=self.verdict.rewards if self.verdict else {},
            verifier_logs=self.verdict.logs if self.verdict else {},
            verifier_observation=self.verdict.observation if self.verdict else None,
            artifacts=self.verdict.artifacts if self.verdict else {},
            notes=[*getattr(self.input.task, "notes", []), *self._storage_used()],
            disk_bytes=self.verdict.disk_bytes if self.verdict else None,
            tokens_after_recovery=state.tokens_after_recovery,
            recovered_turns=state.recovered_turns,
        )

    def _storage_used(self) -> list[str]:
        """A task that declared a storage limit this host cannot enforce is told what it used."""
        limit_mb = getattr(self.input.task, "storage_mb", None)
        if limit_mb is None or self.verdict is None or self.verdict.disk_bytes is None:
            return []
        used_mb = self.verdict.disk_bytes / (1 << 20)
        return [
            f"storage: {used_mb:.1f} MB written over the image when the tests ran (storage_mb {limit_mb} is not enforced here)"
        ]

    # ---------------------------------------------------------------- plumbing

    def _set_status(self, status: TrajectoryStatus) -> None:
        self.status = status
        workflow.upsert_search_attributes(
            [
                TASK_KEY.value_set(self.input.task.id),
                STATUS_KEY.value_set(status),
            ]
        )

    def _should_continue_as_new(self) -> bool:
        steps_this_run = self.state.step - self.first_step_of_run
        return (
            steps_this_run >= self.input.continue_as_new_every
            or workflow.info().is_continue_as_new_suggested()
        )

    def _continue_as_new(self) -> None:
        carried = self.state.model_copy(update={"runs": self.state.runs + 1})
        workflow.continue_as_new(self.input.model_copy(update={"carried": carried}))

    async def _on_placed_host(self, activity: Activity, args, *, key: str, avoid=(), summary: str):
        """`activity` (create or recover) on the host placement names for sandbox `key`. A host
        that refuses (full, draining) or does not answer is avoided and placement asked
        again, up to `PLACEMENT_TRIES` times; while every host is full the call waits for
        room, up to `SHARED_SCHEDULE_TO_START`. With no host publishing its load, or after
        those tries, the shared queue: any host."""
        avoid, waited = list(avoid), timedelta(0)
        for _ in range(PLACEMENT_TRIES):
            placed = await self._place(key, avoid)
            while placed is not None and placed.full and waited < SHARED_SCHEDULE_TO_START:
                await workflow.sleep(ROOM_WAIT)
                waited += ROOM_WAIT
                placed = await self._place(key, avoid)
            if placed is None or placed.host_queue is None:
                break
            try:
                return await self._sandbox_activity(activity, args, queue=placed.host_queue, on_host=True,
                                                    summary=f"{summary} on {placed.host_queue}",
                                                    retry=PLACED_RETRY)  # fmt: skip
            except SandboxLost as refused:
                if refused.cause in CAUSED_BY_AGENT and workflow.patched(SANDBOX_BROKEN_BY_AGENT_PATCH):
                    raise  # the agent's replayed actions broke it: another host would replay them too
                avoid.append(placed.host_queue)
                summary = f"{summary} (refused by {placed.host_queue}: {refused.reason[:60]})"
        return await self._sandbox_activity(activity, args, queue=self.input.queues.sandbox,
                                            summary=summary)  # fmt: skip

    async def _place(self, key: str, avoid) -> PlaceResult | None:
        """Where sandbox `key` should go; None for histories from before placement, or when
        no host answers the question (then the shared queue)."""
        if not workflow.patched(PLACEMENT_PATCH):
            return None
        try:
            return await sandbox.PLACE.execute(
                PlaceArgs(key=key, avoid=avoid),
                task_queue=self.input.queues.sandbox,
                start_to_close_timeout=timedelta(seconds=30),
                schedule_to_start_timeout=SHARED_SCHEDULE_TO_START,
                retry_policy=STORAGE_RETRY,
                summary=f"place sandbox {key}",
            )
        except ActivityError:
            return None

    async def _sandbox_activity(self, activity: Activity, args, *, queue, summary, on_host=False,
                                retry: RetryPolicy = SANDBOX_RETRY):  # fmt: skip
        """A sandbox activity; a lost sandbox or dead host surfaces as `SandboxLost`, and so
        does a host that refuses a new sandbox (`HOST_REFUSED`)."""
        try:
            return await activity.execute(
                args,
                task_queue=queue,
                start_to_close_timeout=_sandbox_activity_limit(args),
                schedule_to_start_timeout=HOST_SCHEDULE_TO_START if on_host else SHARED_SCHEDULE_TO_START,
                heartbeat_timeout=SANDBOX_HEARTBEAT,
                retry_policy=retry,
                summary=summary,
            )
        except ActivityError as err:
            kind = _error_type(err)
            if kind in SANDBOX_LOST or (
                on_host and (kind in {PODMAN_FAILED, *HOST_REFUSED} or _timed_out(err))
            ):
                raise SandboxLost(f"{kind or 'host timeout'}: {_cause(err)}", **_loss_found(err)) from None
            raise InfraFailure(f"{activity.name} failed: {_cause(err)}") from None

    async def _context_activity(self, activity: Activity, args, *, summary):
        """A context activity (a prompt, a fork, an observation nothing generates after, the
        last log entries): local unless the input's queues say otherwise, so it costs no
        round trip of its own. Histories from before `OBSERVATION_WITH_GENERATION_PATCH`
        replay as activities on the context queue."""
        options = {
            "start_to_close_timeout": timedelta(seconds=30),
            "retry_policy": STORAGE_RETRY,
            "summary": summary,
        }
        try:
            if self.input.queues.context_local and self._observation_with_generation():
                return await activity.execute_local(args, **options)
            return await activity.execute(args, task_queue=self.input.queues.context, **options)
        except ActivityError as err:
            raise InfraFailure(f"{activity.name} failed: {_cause(err)}") from None


def _sandbox_activity_limit(args) -> timedelta:
    """Ten minutes for a sandbox activity, longer for one that runs an action allowed more
    (an agent's command, a task's tests with `[verifier].timeout_sec` of 15 minutes): that
    timeout plus a margin for the sandbox's own work, so the activity's limit never cuts
    short what the task allows, and the host's timeout, not Temporal's, ends the action."""
    timeout_s = getattr(getattr(args, "action", None), "timeout_s", None)
    if timeout_s is None:
        return SANDBOX_ACTIVITY_LIMIT
    return max(SANDBOX_ACTIVITY_LIMIT, timedelta(seconds=timeout_s) + ACTION_LIMIT_MARGIN)


class SandboxLost(Exception):
    """The sandbox or its host is gone; `recover` brings it back, unless the host found the
    agent broke it (`cause`, errors.LOST_*; None where nobody looked; `step`: the action
    that was running; `detail`: the host's words)."""

    def __init__(self, reason: str, *, cause: str | None = None, step: int | None = None, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.cause = cause
        self.step = step
        self.detail = detail or reason


def _loss_found(err: ActivityError) -> dict:
    """What the host found about a lost sandbox (SandboxUnreachable.details), as SandboxLost's
    keywords; nothing for an error that carries no finding."""
    cause = err.cause
    if not isinstance(cause, ApplicationError) or not cause.details or not isinstance(cause.details[0], dict):
        return {}
    found = cause.details[0]
    step = found.get("step")
    return {
        "cause": found.get("cause"),
        "step": step if isinstance(step, int) else None,
        "detail": cause.message[:2000],
    }


def _error_type(err: ActivityError) -> str | None:
    cause = err.cause
    return cause.type if isinstance(cause, ApplicationError) else None


def _timed_out(err: ActivityError) -> bool:

    return isinstance(err.cause, TemporalTimeout)


def _cause(err: ActivityError) -> str:
    cause = err.cause
    return f"{type(cause).__name__}: {cause}" if cause else str(err)


def first_line(text: str, limit: int = 60) -> str:
    """A command's first line, cut to `limit`: what an activity's summary in the web UI shows."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"
