"""Batches of rollouts: groups of trajectories per task, forked from one set-up sandbox,
each member run again with the same seed while it ends failed_infra.

`GroupRunner` is the one implementation: a training iteration (`TrainingWorkflow`) and a
`RolloutClient` batch (`RolloutWorkflow`, below) both run their groups through it, so a
trainer that takes its rollouts from the API gets exactly what the built-in loop gets:
the same seeds, forks, retries and outcomes.

Infrastructure failures never become rewards: a member that ends `failed_infra` (or whose
child workflow fails) is run again as a fresh trajectory with the same seed, up to
`max_infra_retries` times; its outcome then stays `failed_infra`, and the caller decides
(a training run drops the group whole). Seeds are hashes of (seed, iteration, task,
member), so a member's outcome does not depend on what failed on the way.

Workflow code only: no I/O, clocks or randomness outside Temporal's APIs.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from belayer.contracts.errors import WRONG_WEIGHTS_VERSION
    from belayer.contracts.publish import WEIGHTS_VERSION
    from belayer.contracts.trainer import RolloutRef
    from belayer.seeding import digest
    from belayer.workflows.groups import GroupRecord, cause_of, run_member
    from belayer.workflows.groups import prepare as prepare_group
    from belayer.workflows.groups import release as release_group
    from belayer.workflows.models import ForkStart, Sampling, TrajectoryInput, TrajectoryResult
    from belayer.workflows.rollout_models import (
        GroupOutcome,
        NestedGroupInput,
        NestedGroupResult,
        RolloutProgress,
        RolloutQueues,
        RolloutRequest,
        RolloutResult,
        RolloutSettings,
    )
    from belayer.workflows.slots import PolledSlots, Slots
    from belayer.workflows.trajectory import STATUS_KEY, TASK_KEY
    from belayer.workloads.models import Task

RUN_KEY = SearchAttributeKey.for_keyword("BelayerRun")
ITERATION_KEY = SearchAttributeKey.for_int("BelayerIteration")

# A queue nobody polls this long has no worker: the run ends failed_infra and says which.
NO_WORKER_AFTER = timedelta(minutes=10)
STORAGE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=10)
# Since this patch a batch never holds more sandboxes than `concurrency`: a group takes its
# members' slots before it forks them (their sandboxes are live while they wait for one),
# and its set-up sandbox goes before the forks start (groups.SETUP_GONE_BEFORE_FORKS_PATCH).
GROUP_SLOTS_PATCH = "groups-take-their-members-slots"
# Since this patch each waiter for slots waits on a future of its own (slots.Slots), not a
# condition re-evaluated for every waiter (slots.PolledSlots).
SLOTS_IN_LINE_PATCH = "slots-granted-in-line"
# Since this patch a batch of more than NEST_ABOVE members runs each group as a child
# workflow of its own (`NestedGroupWorkflow`), its members the group's children: the
# batch's history then grows by a few events per group, not per member. An iteration of
# 10,000 members as direct children made a history of 33,000 events that the Python worker
# could no longer replay within Temporal's 10 s workflow-task timeout.
NESTED_GROUPS_PATCH = "groups-nested-above-256"
NEST_ABOVE = 256


class GroupRunner:
    """Runs groups of `settings.group_size` members for the run or batch `run_id`, keeping
    what its caller shows while they run (members done, in flight) and, with
    `reuse_setup`, each task's set-up checkpoint (`origins`) for later groups to fork."""

    def __init__(self, run_id: str, settings: RolloutSettings, queues: RolloutQueues,
                 origins: dict[str, GroupRecord] | None = None, *, resumed: int = 0) -> None:  # fmt: skip
        self.run_id = run_id
        self.resumed = resumed
        self.nested = False
        self.id_prefix = f"{run_id}-r{resumed}" if resumed else run_id  # a resumed run's ids are new
        self.settings = settings
        self.queues = queues
        self.origins: dict[str, GroupRecord] = dict(origins or {})
        self.limit = asyncio.Semaphore(settings.concurrency)  # a run from before GROUP_SLOTS_PATCH
        self.slots: Slots | PolledSlots | None = None  # chosen with GROUP_SLOTS_PATCH, by _use_slots
        self._slots_patched: bool | None = None
        self.running: set[str] = set()
        self.finished: list[RolloutRef] = []
        self.group_records: list[GroupRecord] = []

    def begin(self, members: int = 0) -> None:
        """A new batch of groups, of `members` trajectories in all: forget the previous one's
        finished members and records; above NEST_ABOVE members, its groups run nested."""
        self.finished, self.group_records = [], []
        self.nested = members > NEST_ABOVE and workflow.patched(NESTED_GROUPS_PATCH)

    async def group(self, iteration: int, task: Task) -> list[RolloutRef]:
        """The group's members, forked from one set-up sandbox (belayer/workflows/groups.py)
        when `fork_groups`, in slots the group takes for them first; their retries start alone."""
        if self.nested:
            return await self._nested_group(iteration, task)
        size = self.settings.group_size
        starts: list[ForkStart | None] = [None] * size
        record = replaced = None
        held = self.settings.fork_groups and self._use_slots() and size <= self.slots.limit
        if held:
            await self.slots.take(size)
        try:
            if self.settings.fork_groups and self._use_slots() and not held:
                record = GroupRecord(group=self.group_id(iteration, task), task=task.id, size=size, fallback=(
                    f"the group ({size}) is larger than the concurrency limit ({self.slots.limit}): "
                    "every member creates its own sandbox when a slot is free"
                ))  # fmt: skip
                self.group_records.append(record)
            elif self.settings.fork_groups:
                record, replaced = await self._prepare(iteration, task, starts)
        except BaseException:
            if held:
                self.slots.give(size)
            raise
        try:
            return list(
                await asyncio.gather(
                    *(
                        self.member(iteration, task, member, prefix="", start=starts[member], held=held)
                        for member in range(size)
                    )
                )
            )
        finally:
            for done in [record if not self.settings.reuse_setup else None, replaced]:
                if done is not None:
                    await release_group(done, self.queues.trajectories)

    async def _prepare(self, iteration: int, task: Task,
                       starts: list[ForkStart | None]) -> tuple[GroupRecord, GroupRecord | None]:  # fmt: skip
        """Fork the group's sandboxes into `starts`; its record, and the origin it replaces."""
        ids = [
            self.trajectory_id(iteration, task, member, prefix="", attempt=0) for member in range(len(starts))
        ]
        kept = self.origins.get(task.id) if self.settings.reuse_setup else None
        record, forked = await prepare_group(self.group_id(iteration, task), task, ids,
                                             self.queues.trajectories, reuse=kept)  # fmt: skip
        starts[:] = forked
        self.group_records.append(record)
        replaced = None
        if self.settings.reuse_setup and record.origin is not None and record.reused_from is None:
            replaced = self._keep_origin(task.id, record)
        return record, replaced

    async def _nested_group(self, iteration: int, task: Task) -> list[RolloutRef]:
        """The group as a `NestedGroupWorkflow`, in the slots it takes for its members (all
        of them, or the whole limit when the group is larger): what `group` does, one level
        down, with the same ids and seeds."""
        self._use_slots()
        held = min(self.settings.group_size, self.slots.limit)
        await self.slots.take(held)
        group_id = self.group_id(iteration, task)
        try:
            result = await run_nested_group(
                NestedGroupInput(run_id=self.run_id, resumed=self.resumed, iteration=iteration, task=task,
                                 settings=self.settings.model_copy(update={"concurrency": held}),
                                 queues=self.queues, origin=self.origins.get(task.id)),
                workflow_id=f"{group_id}-members", task_queue=self.queues.workflows,
                search_attributes=TypedSearchAttributes([SearchAttributePair(RUN_KEY, self.run_id),
                                                         SearchAttributePair(ITERATION_KEY, iteration)]),
            )  # fmt: skip
        finally:
            self.slots.give(held)
        if result.origin is not None and self.settings.reuse_setup:
            self.origins = {**self.origins, task.id: result.origin}
        self.group_records.extend(result.records)
        self.finished.extend(result.members)
        return result.members

    def _use_slots(self) -> bool:
        """Whether this run bounds its sandboxes with `slots` (GROUP_SLOTS_PATCH), decided
        once: a run from before keeps the semaphore it started with."""
        if self._slots_patched is None:
            self._slots_patched = workflow.patched(GROUP_SLOTS_PATCH)
            in_line = self._slots_patched and workflow.patched(SLOTS_IN_LINE_PATCH)
            self.slots = (Slots if in_line else PolledSlots)(self.settings.concurrency)
        return self._slots_patched

    @contextlib.asynccontextmanager
    async def _slot(self, *, taken: bool):
        """The slot one attempt runs in: taken here, or by its group before forking it; given
        back when the attempt ends."""
        if not self._use_slots():
            async with self.limit:
                yield
            return
        if not taken:
            await self.slots.take()
        try:
            yield
        finally:
            self.slots.give()

    async def heldout(self, iteration: int, tasks: list[Task]) -> list[RolloutRef]:
        """One trajectory of each held-out task, never forked."""
        return list(
            await asyncio.gather(*(self.member(iteration, task, 0, prefix="heldout-") for task in tasks))
        )

    async def release_origins(self) -> None:
        """Delete every set-up checkpoint kept: no member will fork or recover from one."""
        kept = list(self.origins.values())
        await asyncio.gather(*(release_group(r, self.queues.trajectories) for r in kept))
        self.origins = {}

    def trajectory_id(self, iteration: int, task: Task, member: int, *, prefix: str, attempt: int) -> str:
        return f"{self.id_prefix}-i{iteration:05d}-{prefix}{task.id}-m{member}-a{attempt}"

    def group_id(self, iteration: int, task: Task) -> str:
        return f"{self.id_prefix}-i{iteration:05d}-{task.id}"

    def record_of(self, task: Task) -> GroupRecord | None:
        """How `task`'s group of this batch got its sandboxes (None when not forked)."""
        return next((r for r in self.group_records if r.task == task.id), None)

    def _keep_origin(self, task_id: str, record: GroupRecord) -> GroupRecord | None:
        """Later groups of `task_id` fork this group's setup; returns the one it replaces
        (its fork failed: no member uses it)."""
        replaced = self.origins.get(task_id)
        self.origins = {**self.origins, task_id: record}
        return replaced

    async def member(self, iteration: int, task: Task, member: int, *, prefix: str,
                     start: ForkStart | None = None, held: bool = False) -> RolloutRef:  # fmt: skip
        """One trajectory of the group, run again (same seed) while it ends failed_infra;
        the first attempt starts from `start` (its group's fork) in the slot its group took
        (`held`), a retry alone in a slot of its own."""
        seed = digest(self.settings.seed, iteration, prefix + task.id, member) % 2**31
        outcome, recovery_s, recoveries = None, 0.0, 0
        for attempt in range(self.settings.max_infra_retries + 1):
            trajectory_id = self.trajectory_id(iteration, task, member, prefix=prefix, attempt=attempt)
            async with self._slot(taken=held and attempt == 0):
                self.running.add(trajectory_id)
                try:
                    result = await self._trajectory(iteration, task, trajectory_id, seed,
                                                    start if attempt == 0 else None)  # fmt: skip
                finally:
                    self.running.discard(trajectory_id)
            recovery_s += sum(r.time_lost_s for r in result.recoveries)
            recoveries += len(result.recoveries)
            outcome = RolloutRef(
                trajectory_id=trajectory_id,
                status=result.status,
                reward=result.reward,
                attempts=attempt + 1,
                reason=result.reason,
                context=result.context,
                recovery_s=recovery_s,
                task=task.id,
                member=member,
                turns=result.turns,
                recoveries=recoveries,
                tokens_after_recovery=result.tokens_after_recovery,
                recovered_tokens_differ=result.recovered_tokens_differ,
            )
            if result.status != "failed_infra":
                break
        self.finished.append(outcome)
        return outcome

    async def _trajectory(self, iteration: int, task: Task, trajectory_id: str, seed: int,
                          start: ForkStart | None) -> TrajectoryResult:  # fmt: skip
        """The child trajectory's result; a child that fails outright counts as failed_infra."""
        input = TrajectoryInput(
            trajectory_id=trajectory_id,
            task=task,
            sampling=Sampling(temperature=self.settings.temperature, seed=seed),
            policy=self.settings.policy,
            queues=self.queues.trajectories,
            max_total_tokens=self.settings.max_total_tokens,
            max_recoveries=self.settings.max_recoveries,
            start_from=start,
        )
        return await run_member(
            input,
            task_queue=self.queues.workflows,
            summary=f"iteration {iteration}: {task.id}",
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(TASK_KEY, task.id),
                    SearchAttributePair(STATUS_KEY, "running"),
                    SearchAttributePair(RUN_KEY, self.run_id),
                    SearchAttributePair(ITERATION_KEY, iteration),
                ]
            ),
        )


async def node_versions(queues: list[str]) -> list[int]:
    """The weights version each node serves; `ApplicationError` naming a queue nobody polls."""
    return list(await asyncio.gather(*(_node_version(queue) for queue in queues)))


async def _node_version(queue: str) -> int:
    try:
        return await WEIGHTS_VERSION.execute(
            task_queue=queue,
            schedule_to_start_timeout=NO_WORKER_AFTER,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=STORAGE_RETRY,
            summary=f"weights version served by {queue}",
        )
    except ActivityError as err:
        raise ApplicationError(f"rollout node queue {queue} does not answer: {cause_of(err)}") from None


async def run_nested_group(input: NestedGroupInput, *, workflow_id: str, task_queue: str,
                           search_attributes) -> NestedGroupResult:  # fmt: skip
    """The group's outcome; a group workflow that fails outright leaves every member
    failed_infra (never a reward), and the caller drops the group."""
    try:
        return await workflow.execute_child_workflow(
            "NestedGroupWorkflow", input, id=workflow_id, task_queue=task_queue,
            result_type=NestedGroupResult, search_attributes=search_attributes,
            static_summary=f"iteration {input.iteration}: {input.task.id}, {input.settings.group_size} members",
        )  # fmt: skip
    except ChildWorkflowError as err:
        reason = f"group workflow failed: {cause_of(err)}"
        return NestedGroupResult(records=[], members=[
            RolloutRef(trajectory_id=f"{workflow_id}-m{member}", status="failed_infra", reward=None, attempts=1,
                       reason=reason, task=input.task.id, member=member)
            for member in range(input.settings.group_size)
        ])  # fmt: skip


@workflow.defn(name="NestedGroupWorkflow")
class NestedGroupWorkflow:
    """One group of a large batch (GroupRunner, above NEST_ABOVE members): its members as
    children of their own, run exactly as `GroupRunner.group` runs them in the batch."""

    @workflow.run
    async def run(self, input: NestedGroupInput) -> NestedGroupResult:
        origins = {input.task.id: input.origin} if input.origin is not None else {}
        runner = GroupRunner(input.run_id, input.settings, input.queues, origins, resumed=input.resumed)
        members = await runner.group(input.iteration, input.task)
        return NestedGroupResult(members=members, records=runner.group_records,
                                 origin=runner.origins.get(input.task.id))  # fmt: skip


@workflow.defn(name="RolloutWorkflow")
class RolloutWorkflow:
    """One batch of a `RolloutClient` (belayer/rollouts.py): a group per task, run as a
    training iteration's groups are; `progress` lists the members done so far, so the
    client streams them as they end. Its id is the batch id; its trajectories carry it as
    BelayerRun, so the web UI lists them together."""

    @workflow.init
    def __init__(self, input: RolloutRequest) -> None:
        self.input = input
        self.runner = GroupRunner(input.batch_id, input.settings, input.queues)

    @workflow.query(name="progress")
    def progress(self) -> RolloutProgress:
        return RolloutProgress(
            batch_id=self.input.batch_id,
            members_total=len(self.input.tasks) * self.input.settings.group_size,
            finished=self.runner.finished,
            running=sorted(self.runner.running),
        )

    @workflow.run
    async def run(self, input: RolloutRequest) -> RolloutResult:
        if input.weights_version is not None:
            await self._check_version(input.weights_version)
        try:
            groups = await asyncio.gather(*(self.runner.group(0, task) for task in input.tasks))
        finally:
            await self.runner.release_origins()
        return RolloutResult(
            batch_id=input.batch_id,
            groups=[
                GroupOutcome(task=task.id, members=members, sandboxes=self.runner.record_of(task))
                for task, members in zip(input.tasks, groups, strict=True)
            ],
        )

    async def _check_version(self, wanted: int) -> None:
        """The batch samples `wanted`, or does not start: a node on another version fails it
        at once, naming both (publish first, then generate)."""
        served = await node_versions(self.input.queues.nodes)
        wrong = [
            f"{q} serves v{v}" for q, v in zip(self.input.queues.nodes, served, strict=True) if v != wanted
        ]
        if wrong:
            raise ApplicationError(
                f"the batch asks for weights v{wanted} but {', '.join(wrong)}; publish v{wanted} "
                "(RolloutClient.publish) before generating, or leave weights_version out",
                type=WRONG_WEIGHTS_VERSION,
                non_retryable=True,
            )
