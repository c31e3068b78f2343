"""The chaos soak behind `belayer bench chaos`: the example workloads, many times, under a
seeded schedule of real faults of every kind, each trajectory compared with an unfailed
run of its task.

One reference round runs every task with no fault. Then each round starts every task
(times `repeats`, and with `group_size` also as a group of forked members) at once and
injects `faults_per_round` faults one after another, each on a trajectory and at a step
(or a time offset) drawn from the seed; fault kinds come in turn from a seeded shuffle
of all kinds, so `rounds * faults_per_round >= 11` covers every kind. Besides the
process faults of belayer/chaos/faults.py the soak has two of its own: `terminate` (the
trajectory's workflow terminated from Temporal, where no workflow code runs: the host's
reaper must remove its sandbox) and `drain` (the sandbox's host drained, as a platform
takes a machine: every sandbox on it moves to another host; then the host comes back).
A fault's recovery time runs from the injection until its trajectory completes another
step (or ends); a termination's, until its sandbox is gone from its host. After the last
round, whatever the run left behind is counted from the hosts themselves (belayer/chaos/leaks.py).

Verdicts per trajectory, against the reference of its task (a group member's, against
the reference round's member of the same task):
- terminated: the soak terminated it (its `terminate` fault): expected, and not a loss;
- lost: no result (the workflow failed, was terminated by anything else, or did not
  finish in time);
- failed_infra: ended failed_infra (infrastructure failures are never rewards);
- context_cut: a recovery found a nondeterministic action and cut the context there:
  its hashes legitimately differ; counted apart, and its recovery must say where;
- mismatched: completed without a cut, but token_sha256 or env_sha256 differ.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field
from temporalio.client import WorkflowFailureError
from temporalio.service import RPCError

from belayer.chaos import leaks
from belayer.chaos.faults import FAULT_KINDS, RECOVERED_BY, Chaos, ChaosError, FaultReport, node_roles
from belayer.client import follow_trajectories, start_group, start_trajectory, trajectory_input
from belayer.config import BelayerConfig
from belayer.errors import BelayerError, StackError
from belayer.measure import spread
from belayer.rollout.status import NodeStatus
from belayer.stack import sandbox_hosts
from belayer.stack.drain import drain_host
from belayer.stack.local import LocalStack
from belayer.storage.store import open_store
from belayer.storage.tokenlog import PrefixRef
from belayer.storage.trajectory_tokens import read_trajectory_tokens, where_they_part
from belayer.temporal_client import connect
from belayer.workers.rollout.worker import generation_of, recoveries_of
from belayer.workflows.groups import GroupInput
from belayer.workloads.loader import load_workload
from belayer.workloads.registry import driver_for

Reporter = Callable[[str], None]

# Faults only the soak injects: it holds the Temporal client and the stack they need.
SOAK_ONLY_KINDS: tuple[str, ...] = ("terminate", "drain")
SOAK_FAULT_KINDS: tuple[str, ...] = (*FAULT_KINDS, *SOAK_ONLY_KINDS)
# The reaper's promise (belayer/sandbox/reaper.py): a closed workflow's sandbox is gone within 60 s.
REAPED_WITHIN_S = 60.0
DRAIN_DEADLINE_S = 60.0
# A fault whose round ended before it found a target: it moves to the next round.
CARRIED_OVER = "not injected: every trajectory of the round had finished; carried over"


def default_kinds(sandbox_hosts_count: int) -> list[str]:
    """Every kind the stack can take: a drain needs a second host to move sandboxes to."""
    return [k for k in SOAK_FAULT_KINDS if k != "drain" or sandbox_hosts_count >= 2]


class SoakSettings(BaseModel):
    """Size and schedule of one soak."""

    workloads: list[Path] = Field(description="Workload files whose tasks run every round.")
    rounds: int = Field(5, ge=1, description="Rounds with faults (after one reference round).")
    repeats: int = Field(1, ge=1, description="Trajectories per task per round.")
    group_size: int = Field(
        0,
        ge=0,
        description="Also run each task as a group of this many members forked from one set-up (0: none).",
    )
    faults_per_round: int = Field(2, ge=0, description="Faults injected, one after another, per round.")
    seed: int = Field(0, ge=0, description="Seed of the fault schedule.")
    kinds: list[str] = Field(list(FAULT_KINDS), description="Fault kinds drawn from (SOAK_FAULT_KINDS).")
    time_trigger_share: float = Field(0.25, ge=0, le=1, description="Share of faults triggered by time.")
    s3_outage_s: float = Field(3.0, ge=0, description="How long an s3-outage keeps the store down.")
    round_timeout_s: float = Field(600.0, gt=0, description="A trajectory not done by then is lost.")
    extra_rounds: int = Field(2, ge=0, description="Rounds added for faults that found no running target.")


class ScheduledFault(BaseModel):
    kind: str
    target: int = Field(description="Index of the target among the round's trajectories.")
    step: int | None = None
    t: float | None = None


class FaultRecord(BaseModel):
    kind: str
    round: int
    target: str
    trigger: str
    at: int | None = Field(None, description="Step the target had completed at the injection.")
    injected_at: float | None = None
    recovered_by: str | None = None
    recovery_s: float | None = None
    injected: bool = False
    detail: str = ""


class TrajectoryOutcome(BaseModel):
    id: str
    task: str
    round: int
    member: int | None = Field(
        None, description="Its place in its task's group (forked from one set-up); None alone."
    )
    status: str
    verdict: str
    turns: int = 0
    token_sha256: str | None = None
    env_sha256: str | None = None
    recoveries: list[dict] = []
    checkpoints: int = 0
    sandbox_ids: list[str] = []
    started_at: float
    ended_at: float | None = None
    step_times: list[tuple[int, float]] = Field([], description="(step, time first seen) as polled.")
    reason: str = ""
    context: dict | None = Field(
        None, description="Its token log (PrefixRef), to compare with its reference's."
    )
    parted: str = Field("", description="A mismatched run: where its tokens part from its reference's.")


def schedule(settings: SoakSettings, turns: list[int]) -> list[list[ScheduledFault]]:
    """Per round, the faults to inject, in order. `turns[i]` is trajectory i's step count."""
    rng = random.Random(settings.seed)
    order = list(settings.kinds)
    rng.shuffle(order)
    plan: list[list[ScheduledFault]] = []
    drawn = 0
    for _ in range(settings.rounds):
        faults = []
        for _ in range(settings.faults_per_round):
            kind = order[drawn % len(order)]
            drawn += 1
            target = rng.randrange(len(turns))
            if rng.random() < settings.time_trigger_share:
                faults.append(ScheduledFault(kind=kind, target=target, t=round(rng.uniform(2, 20), 1)))
            else:
                faults.append(
                    ScheduledFault(kind=kind, target=target, step=rng.randint(1, max(1, turns[target] - 1)))
                )
        plan.append(faults)
    return plan


class Soak:
    def __init__(self, config: BelayerConfig, settings: SoakSettings, report: Reporter = lambda _m: None):
        self.config = config
        self.settings = settings
        self.report = report
        self.tasks = [task for path in settings.workloads for task in load_workload(path).tasks]
        self.chaos = Chaos(config)
        self.run_id = uuid.uuid4().hex[:6]
        self.faults: list[FaultRecord] = []
        self.outcomes: list[TrajectoryOutcome] = []
        self.references: dict[tuple[str, int | None], TrajectoryOutcome] = {}
        self.progress: dict[str, object] = {}
        self.finished: set[str] = set()
        self.grouped: set[str] = set()  # trajectories that are members of a group
        self.terminated: set[str] = set()  # trajectories the soak terminated (its `terminate` faults)
        self.reaping: list[asyncio.Future] = []  # a terminated trajectory's sandbox, watched until removed
        self.draining: asyncio.Future | None = None
        self.carried: list[ScheduledFault] = []

    async def run(self) -> dict:
        started = time.monotonic()
        before = await asyncio.to_thread(leaks.snapshot, self.config)
        self.client = await connect(self.config.temporal, self.config.storage.encryption_key)
        self.report("reference round: every task once, no faults")
        for outcome in await self._round(0, []):
            self.references.setdefault((outcome.task, outcome.member), outcome)
        members = self.settings.group_size if self.settings.group_size >= 2 else 0
        inputs_turns = [_turns(task) for task in self.tasks for _ in range(self.settings.repeats)] + [
            _turns(task) for task in self.tasks for _ in range(members)
        ]
        rounds = schedule(self.settings, inputs_turns)
        # A fault whose round ended before it could hit (every trajectory finished while an
        # earlier fault recovered) moves to the next round, so every kind is really injected.
        rounds += [[] for _ in range(self.settings.extra_rounds)]
        for number, scheduled in enumerate(rounds, start=1):
            faults = [*self.carried, *scheduled]
            self.carried = []
            if number > self.settings.rounds and not faults:
                break
            self.report(
                f"round {number}/{self.settings.rounds}: {', '.join(f.kind for f in faults) or 'no faults'}"
            )
            await self._wait_healthy()
            self.outcomes.extend(await self._round(number, faults))
        await self._wait_healthy()
        sandbox_ids = {sid for o in [*self.outcomes, *self.references.values()] for sid in o.sandbox_ids}
        found = await self._leaks_after_reaping(before, sandbox_ids)
        return self._summary(found, time.monotonic() - started)

    async def _leaks_after_reaping(self, before, sandbox_ids: set[str]) -> leaks.Leaks:
        """What the run left behind, once the reapers had their time: a terminated
        trajectory's sandbox may stand for up to REAPED_WITHIN_S after its end."""
        deadline = time.monotonic() + REAPED_WITHIN_S + 15
        while True:
            found = await asyncio.to_thread(leaks.find_leaks, self.config, before, sandbox_ids)
            if not any(found.counts().values()) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(5)

    # ---------------------------------------------------------------- one round

    async def _round(self, number: int, faults: list[ScheduledFault]) -> list[TrajectoryOutcome]:
        run_id = f"soak{self.run_id}r{number}"
        inputs = [
            trajectory_input(self.config, task, repeat=repeat, run_id=run_id)
            for task in self.tasks
            for repeat in range(self.settings.repeats)
        ]
        groups = (
            [self._group_input(task, run_id) for task in self.tasks] if self.settings.group_size >= 2 else []
        )
        members = [m.trajectory_id for group in groups for m in group.members]
        self.grouped.update(members)
        begun = time.monotonic()
        jobs = [asyncio.ensure_future(self._follow(number, item)) for item in inputs]
        group_jobs = [asyncio.ensure_future(self._follow_group(number, group)) for group in groups]
        chaos = asyncio.ensure_future(
            self._inject_all(number, faults, [i.trajectory_id for i in inputs] + members, begun)
        )
        outcomes = [
            *await asyncio.gather(*jobs),
            *(o for mine in await asyncio.gather(*group_jobs) for o in mine),
        ]
        # Every trajectory has ended, so each pending fault finds no target and an injected
        # one stops measuring: let it write its record (an injection under way completes).
        try:
            await asyncio.wait_for(asyncio.shield(chaos), 300)
        except TimeoutError:
            chaos.cancel()
            await asyncio.gather(chaos, return_exceptions=True)
        await asyncio.gather(*self.reaping)
        self.reaping = []
        for outcome in outcomes:
            outcome.verdict = self._verdict(outcome) if number else "reference"
            if outcome.verdict == "mismatched":
                outcome.parted = await asyncio.to_thread(self._where_parted, outcome)
        return list(outcomes)

    def _group_input(self, task, run_id: str) -> GroupInput:
        """One group of `group_size` members of `task`, each with the lone trajectories' seed."""
        members = [
            trajectory_input(self.config, task, repeat=m, run_id=f"{run_id}g")
            for m in range(self.settings.group_size)
        ]
        return GroupInput(group_id=f"group-{task.id}-{run_id}", members=members,
                          workflow_queue=self.config.temporal.workflow_task_queue)  # fmt: skip

    async def _follow(self, number: int, input) -> TrajectoryOutcome:
        """Start one trajectory and follow it to its end; Temporal outages are waited out."""

        tid = input.trajectory_id
        outcome = TrajectoryOutcome(
            id=tid, task=input.task.id, round=number, status="running", verdict="", started_at=time.time()
        )
        deadline = asyncio.get_running_loop().time() + self.settings.round_timeout_s
        handle = await _retrying(lambda: start_trajectory(self.client, self.config, input))
        try:
            async with asyncio.timeout_at(deadline):
                async for seen in follow_trajectories(handle, query_timeout_s=5):
                    self._saw(outcome, seen)
                result = await _result_through_outages(handle)
        except WorkflowFailureError as exc:
            if tid in self.terminated:
                outcome.status, outcome.reason = (
                    "terminated",
                    "terminated from Temporal by the soak (fault terminate)",
                )
            else:
                outcome.status, outcome.reason = "lost", f"workflow failed: {exc.cause or exc}"
        except TimeoutError:
            outcome.status, outcome.reason = "lost", f"no result within {self.settings.round_timeout_s:.0f}s"
            await _terminate(handle, "belayer bench chaos: round timeout")
        else:
            _take_result(outcome, result)
        finally:
            outcome.ended_at = time.time()
            self.finished.add(tid)
        return outcome

    async def _follow_group(self, number: int, group: GroupInput) -> list[TrajectoryOutcome]:
        """Start one group and follow its members to their ends, as `_follow` one trajectory."""

        outcomes = {
            m.trajectory_id: TrajectoryOutcome(
                id=m.trajectory_id,
                task=m.task.id,
                round=number,
                member=place,
                status="running",
                verdict="",
                started_at=time.time(),
            )  # fmt: skip
            for place, m in enumerate(group.members)
        }
        deadline = asyncio.get_running_loop().time() + self.settings.round_timeout_s
        handle = await _retrying(lambda: start_group(self.client, self.config, group))
        watched = [self.client.get_workflow_handle(t) for t in outcomes]
        lost = ""
        try:
            async with asyncio.timeout_at(deadline):
                async for seen in follow_trajectories(handle, watched, query_timeout_s=5):
                    self._saw(outcomes[seen.trajectory_id], seen)
                done = await _result_through_outages(handle)
        except WorkflowFailureError as exc:
            lost = f"its group's workflow failed: {exc.cause or exc}"
        except TimeoutError:
            lost = f"its group had no result within {self.settings.round_timeout_s:.0f}s"
            await _terminate(handle, "belayer bench chaos: round timeout")
        else:
            for result in done.results:
                _take_result(outcomes[result.trajectory_id], result)
            lost = "no result of its own in its group's"
        finally:
            for outcome in outcomes.values():
                if outcome.status == "running":
                    outcome.status, outcome.reason = "lost", lost
                outcome.ended_at = time.time()
                self.finished.add(outcome.id)
        return list(outcomes.values())

    def _saw(self, outcome: TrajectoryOutcome, seen) -> None:
        """Note a progress snapshot: when each step began, and every sandbox it had."""
        self.progress[outcome.id] = seen
        if not outcome.step_times or outcome.step_times[-1][0] != seen.step:
            outcome.step_times.append((seen.step, time.time()))
        if seen.sandbox and seen.sandbox.sandbox_id not in outcome.sandbox_ids:
            outcome.sandbox_ids.append(seen.sandbox.sandbox_id)

    def _verdict(self, outcome: TrajectoryOutcome) -> str:
        if outcome.status == "terminated":
            return "terminated"
        if outcome.status == "lost":
            return "lost"
        if outcome.status == "failed_infra":
            return "failed_infra"
        if any(r.get("cut_after_step") for r in outcome.recoveries):
            return "context_cut"
        reference = self.references.get((outcome.task, outcome.member))
        if (
            reference is None
            or reference.status != outcome.status
            or (reference.token_sha256, reference.env_sha256) != (outcome.token_sha256, outcome.env_sha256)
        ):
            return "mismatched"
        return "ok"

    def _where_parted(self, outcome: TrajectoryOutcome) -> str:
        """Where a mismatched run's tokens part from its reference's (`where_they_part`):
        an observation that differs with no recovery before it is the environment's own
        race, a generated token a near-tie or a different context."""
        reference = self.references.get((outcome.task, outcome.member))
        if reference is None or outcome.context is None or reference.context is None:
            return "no token log to compare"
        try:
            with open_store(self.config.storage, encrypted=False) as store:
                ours, theirs = (
                    read_trajectory_tokens(store, PrefixRef.model_validate(o.context))
                    for o in (outcome, reference)
                )
        except Exception as exc:  # a diagnosis only: the verdict stands without it
            return f"token logs unreadable: {exc}"
        env = "" if outcome.env_sha256 == reference.env_sha256 else "; the workspaces differ too"
        return where_they_part(ours, theirs) + env

    # ---------------------------------------------------------------- faults

    async def _inject_all(
        self, number: int, faults: list[ScheduledFault], ids: list[str], begun: float
    ) -> None:
        for planned in faults:
            target = ids[planned.target]
            if not self._may_hit(planned.kind, target):
                target = next((i for i in ids if self._going(i) and self._may_hit(planned.kind, i)), target)
            record = FaultRecord(
                kind=planned.kind,
                round=number,
                target=target,
                trigger=f"step={planned.step}" if planned.step is not None else f"t={planned.t}",
            )
            self.faults.append(record)
            seen = (
                await self._trigger(planned, target, begun) if self._may_hit(planned.kind, target) else None
            )
            if seen is None:  # the target ended first: any trajectory still running will do
                target = next((i for i in ids if self._going(i) and self._has_sandbox(i)
                               and self._may_hit(planned.kind, i)), None)  # fmt: skip
                seen = self.progress.get(target) if target else None
                record.target = target or record.target
                record.trigger += " (retargeted)"
            if seen is None:
                record.recovered_by = CARRIED_OVER
                self.carried.append(planned.model_copy(update={"step": 1, "t": None}))
                continue
            await self._inject(record, seen)

    def _going(self, trajectory: str) -> bool:
        """Not ended, and not terminated by the soak (its follower may not know yet)."""
        return trajectory not in self.finished and trajectory not in self.terminated

    def _may_hit(self, kind: str, trajectory: str) -> bool:
        """A group runs again a member that ends without a result of its own, so `terminate`
        hits lone trajectories only; every other kind hits any."""
        return kind != "terminate" or trajectory not in self.grouped

    def _has_sandbox(self, trajectory: str) -> bool:
        seen = self.progress.get(trajectory)
        return seen is not None and seen.sandbox is not None

    async def _trigger(self, planned: ScheduledFault, target: str, begun: float):
        while self._going(target):
            seen = self.progress.get(target)
            if seen is not None and seen.sandbox is not None:
                if planned.step is not None and seen.step >= planned.step:
                    return seen
                if planned.t is not None and time.monotonic() - begun >= planned.t:
                    return seen
            await asyncio.sleep(0.1)
        return None

    async def _inject(self, record: FaultRecord, seen) -> None:
        roles_before = node_roles(self.chaos.config)
        recoveries_before = len(seen.recoveries)
        try:
            report = await self._fault(record, seen)
        except BelayerError as exc:  # its target went, or a host's podman died under another fault
            record.recovered_by = f"not injected: {exc}"
            return
        record.injected, record.at, record.injected_at = True, seen.step, report.at
        record.detail = f"{report.target}: {report.detail}"
        self.report(f"  {record.kind} on {record.target} at step {seen.step}: {report.detail}")
        if record.kind == "terminate":
            # measured aside: the round's next faults need not wait for the reaper
            self.reaping.append(
                asyncio.ensure_future(self._until_reaped(record, seen.sandbox.sandbox_id, report.at))
            )
            return
        while self._going(record.target):
            now = self.progress.get(record.target)
            if now is not None and now.step > seen.step:
                break
            await asyncio.sleep(0.1)
        record.recovery_s = round(time.time() - report.at, 3)
        if record.kind == "drain":
            await self._drained(record)
        if record.kind == "drain" or report.detail.endswith("left down"):
            # a platform replaces the machine it took or lost: later faults find the whole stack
            await asyncio.to_thread(self._stack_back)
        if record.kind.startswith("engine"):
            # the step may complete before the node notices (no request was in flight):
            # what recovered it is named once the node has acted, recovery_s stays as measured
            await self._await_node_recovery(roles_before)
        record.recovered_by = self._recovered_by(record, roles_before, recoveries_before)

    async def _fault(self, record: FaultRecord, seen) -> FaultReport:
        """Inject `record.kind` at the trajectory `seen` shows (its sandbox, its node)."""
        at = time.time()
        if record.kind == "terminate":
            self.terminated.add(record.target)
            try:
                await self.client.get_workflow_handle(record.target).terminate(
                    reason="belayer bench chaos: fault terminate"
                )
            except RPCError as exc:  # it ended first, or the server is away: not terminated
                self.terminated.discard(record.target)
                raise ChaosError(f"Temporal did not terminate {record.target}: {exc}") from None
            return FaultReport(kind=record.kind, target=record.target, at=at,
                               detail="its workflow terminated from Temporal (no workflow code runs)")  # fmt: skip
        if record.kind == "drain":
            # the drain goes on while the target is watched: its sandbox moves long before
            # the host's worker, its last answers given, exits
            stack = LocalStack(self.config)
            host = stack.sandbox_host(seen.sandbox.host_queue)
            self.draining = asyncio.ensure_future(
                asyncio.to_thread(drain_host, stack, host.name, DRAIN_DEADLINE_S)
            )
            return FaultReport(kind=record.kind, target=f"sandbox host {sandbox_hosts.host_name(host.host_index)}",
                               at=at, detail="drain started (SIGTERM to its worker)")  # fmt: skip
        return await asyncio.to_thread(
            self.chaos.inject,
            record.kind,
            sandbox_container=seen.sandbox.container,
            duration_s=self.settings.s3_outage_s,
            node_queue=seen.node_queue,
        )

    async def _drained(self, record: FaultRecord) -> None:
        """The drain's end: its report into the record."""
        try:
            drained = await self.draining
            record.detail += f"; drained in {drained.emptied_s or 0:.2f}s: {drained.counts()}"
        except StackError as exc:
            record.detail += f"; the drain failed: {exc}"

    def _stack_back(self) -> None:
        """`belayer up`: what a fault left down (a node or host of several, a drained host)
        starts again with the stack's settings; what runs is left alone."""
        LocalStack(self.config).up()

    async def _until_reaped(self, record: FaultRecord, sandbox_id: str, since: float) -> None:
        """A terminated trajectory ran no code of its own: the host's reaper must remove its
        sandbox; its recovery is the time until no host holds a container of it, of any
        generation (the one the last progress named may have been replaced since)."""
        deadline = time.monotonic() + REAPED_WITHIN_S + 30
        while time.monotonic() < deadline:
            if not await asyncio.to_thread(self._sandbox_exists, sandbox_id):
                record.recovery_s = round(time.time() - since, 3)
                record.recovered_by = RECOVERED_BY["terminate"]
                return
            await asyncio.sleep(0.5)
        record.recovered_by = (
            f"its sandbox {sandbox_id} was still on a host after {REAPED_WITHIN_S + 30:.0f}s"
        )

    def _sandbox_exists(self, sandbox_id: str) -> bool:
        """Whether any host still lists a container of `sandbox_id`; a host whose podman
        cannot answer now (another fault took it) may still hold one."""
        try:
            hosts = LocalStack(self.config).sandbox_hosts
            return sandbox_hosts.host_of_sandbox(self.config, hosts, sandbox_id) is not None
        except Exception:  # noqa: BLE001 -- its podman was killed under it: ask again later
            return True

    async def _await_node_recovery(self, roles_before: NodeStatus | None, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if recoveries_of(node_roles(self.chaos.config)) > recoveries_of(roles_before):
                return
            await asyncio.sleep(0.2)

    def _recovered_by(
        self, record: FaultRecord, roles_before: NodeStatus | None, recoveries_before: int
    ) -> str:
        roles_after = node_roles(self.chaos.config)
        if record.kind.startswith(("engine", "owner")):
            if recoveries_of(roles_after) > recoveries_of(roles_before):
                return roles_after.last_recovery.kind if roles_after.last_recovery else "takeover"
            if record.kind == "owner-crash" and generation_of(roles_after) > generation_of(roles_before):
                return "owner replaced: it adopted the verified segments; the leader kept serving"
            return "no node recovery seen"
        now = self.progress.get(record.target)
        if record.kind in ("sandbox-crash", "sandbox-host-crash", "drain"):
            if now is not None and len(now.recoveries) > recoveries_before:
                rec = now.recoveries[-1]
                return f"{'moved' if record.kind == 'drain' else 'restore+replay'} from {rec.source}"
            if record.kind == "drain":
                return "went on without a move (its sandbox had left the host, or it ended first)"
            return "restore+replay (seen in the result)"
        return RECOVERED_BY[record.kind]

    async def _wait_healthy(self, timeout_s: float = 240.0) -> None:
        """Between rounds every component must be back; one that is not is reported, not hidden."""

        deadline = time.monotonic() + timeout_s
        while True:
            rows = await asyncio.to_thread(LocalStack(self.config).status)
            sick = [f"{r.name}: {r.detail}" for r in rows if not r.healthy]
            if not sick:
                return
            if time.monotonic() > deadline:
                raise ChaosError(f"the stack did not come back within {timeout_s:.0f}s: {'; '.join(sick)}")
            await asyncio.sleep(1)

    # ---------------------------------------------------------------- summary

    def _summary(self, found, wall_s: float) -> dict:
        injected = [f for f in self.faults if f.injected]
        verdicts = [o.verdict for o in self.outcomes]
        cuts = [o for o in self.outcomes if o.verdict == "context_cut"]
        recovery = recovery_figures(injected, self.settings.kinds)
        round_walls = round_wall_s(self.outcomes)
        return {
            "trajectories": len(self.outcomes),
            "faults_injected": len(injected),
            "by_kind": recovery["by_kind"],
            "lost": verdicts.count("lost"),
            "terminated": verdicts.count("terminated"),
            "mismatched": verdicts.count("mismatched"),
            "failed_infra": verdicts.count("failed_infra"),
            "context_cuts": len(cuts),
            "leaked": found.counts(),
            "p50_recovery_s": recovery["p50_recovery_s"],
            "p99_recovery_s": recovery["p99_recovery_s"],
            "recovery_s_spread": recovery["recovery_s_spread"],
            # a fault carried to the next round is one fault, however many rounds it waited
            "faults_not_injected": len(self.carried)
            + sum(not f.injected and f.recovered_by != CARRIED_OVER for f in self.faults),
            "seed": self.settings.seed,
            "rounds": self.settings.rounds,
            "rounds_run": len(round_walls),
            "round_wall_s_spread": spread(round_walls, digits=1),
            "wall_s": round(wall_s, 1),
            "details": {
                "references": {
                    task if member is None else f"{task} member {member}": o.model_dump()
                    for (task, member), o in self.references.items()
                },
                "runs": [o.model_dump() for o in self.outcomes],
                "faults": [f.model_dump() for f in self.faults],
                "round_wall_s": round_walls,
                "leaks": found.model_dump(),
            },
        }


def recovery_figures(injected: list[FaultRecord], kinds: list[str]) -> dict:
    """Recovery seconds of the injected faults, per kind and over all: the soak's rounds are
    its repetitions, so besides the nearest-rank p50 / p99 (and each kind's max) every
    figure has its min / median / max (`recovery_s_spread`; None where none recovered)."""
    times = [f.recovery_s for f in injected if f.recovery_s is not None]
    by_kind = {}
    for kind in kinds:
        mine = [f for f in injected if f.kind == kind]
        kind_times = [f.recovery_s for f in mine if f.recovery_s is not None]
        by_kind[kind] = {
            "injected": len(mine),
            "p50_recovery_s": percentile(kind_times, 0.5),
            "max_recovery_s": max(kind_times) if kind_times else None,
            "recovery_s_spread": spread(kind_times),
        }
    return {
        "by_kind": by_kind,
        "p50_recovery_s": percentile(times, 0.5),
        "p99_recovery_s": percentile(times, 0.99),
        "recovery_s_spread": spread(times),
    }


def round_wall_s(outcomes: list[TrajectoryOutcome]) -> list[float]:
    """Per round with faults, in order: its first trajectory's start to its last one's end."""
    rounds: dict[int, list[TrajectoryOutcome]] = {}
    for outcome in outcomes:
        rounds.setdefault(outcome.round, []).append(outcome)
    return [
        round(max(o.ended_at or o.started_at for o in mine) - min(o.started_at for o in mine), 1)
        for _, mine in sorted(rounds.items())
    ]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _take_result(outcome: TrajectoryOutcome, result) -> None:
    """A trajectory's result (TrajectoryResult) into its outcome."""
    outcome.status, outcome.reason = result.status, result.reason
    outcome.turns, outcome.token_sha256, outcome.env_sha256 = (
        result.turns,
        result.token_sha256,
        result.env_sha256,
    )
    outcome.recoveries = [r.model_dump() for r in result.recoveries]
    outcome.checkpoints = result.checkpoints
    outcome.context = result.context.model_dump(mode="json") if result.context else None


def _turns(task) -> int:
    return driver_for(task).turn_limit(task)


async def _retrying(start, attempts: int = 30):
    for attempt in range(attempts):
        try:
            return await start()
        except RPCError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(1)


async def _result_through_outages(handle):
    """The trajectory's result; any RPC, runtime or OS error (the server being restarted
    by this very run) is waited out and the result asked again."""

    while True:
        try:
            return await handle.result()
        except (RPCError, RuntimeError, OSError):
            await asyncio.sleep(1)


async def _terminate(handle, reason: str) -> None:
    try:
        await handle.terminate(reason=reason)
    except Exception:  # already closed
        pass
