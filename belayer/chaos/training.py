"""Real faults against a running training run (`belayer train --chaos`).

A planned fault (`FAULT@iteration=K`) fires during iteration K, or the first iteration
after it where it can: a rollout-side fault (engine, owner, node, sandbox, sandbox host,
workflow worker, Temporal, S3) once a trajectory of the iteration has run an action (its
sandbox is the target of `sandbox-crash`), `trainer-crash` once the iteration's train
step has started. Faults go one at a time; each is measured until what it hit moves on
(the trajectory runs its next step or ends; the run leaves the train step), which is its
`recovery_s`. A fault that hits the whole run rather than one trajectory (Temporal, its
workflow worker, S3) also takes the train step as its chance when no trajectory offers
one, so a fault the recoveries before it pushed into the last iteration's train step is
still injected. Time triggers (`FAULT@t=SECONDS`) fire on the clock and hit whatever is
running then.
"""

from __future__ import annotations

import asyncio
import time

from temporalio.client import WorkflowExecutionStatus

from belayer.chaos.faults import RECOVERED_BY, Chaos, ChaosError, node_roles
from belayer.chaos.plan import PlannedFault
from belayer.client import trajectory_progress
from belayer.training import run_progress
from belayer.workers.rollout.worker import recoveries_of
from belayer.workloads.models import TraceTask

POLL_S = 0.25
FIRST_GENERATION_POLL_S = 0.05
# Faults of the run's services, not of one trajectory: the training workflow and its train
# step depend on them as much as any trajectory does.
RUN_WIDE_FAULTS = frozenset({"temporal-worker-crash", "temporal-restart", "s3-outage"})


class TrainingChaos:
    """Injects `plan` into run `run_id` while it runs; `faults` holds one record per fault."""

    def __init__(self, config, client, run_id: str, plan: list[PlannedFault], say=None, *,
                 policy_tasks: frozenset[str] = frozenset()):  # fmt: skip
        self.config, self.client, self.run_id = config, client, run_id
        self.policy_tasks = policy_tasks  # the ids of the tasks the policy acts in (first-generation faults)
        self.say = say or (lambda _line: None)
        self.pending = list(plan)
        self.faults: list[dict] = []
        self.chaos = Chaos(config)
        self.windows = FirstGenerationWindows()
        self.started = time.monotonic()

    async def run(self) -> None:
        """Until every planned fault is injected; cancelled when the run ends (what is
        still pending is then recorded as not injected, by `settle`)."""
        while self.pending:
            progress = await self._progress()
            running = await self._running(progress)
            if progress is not None:
                self.windows.observe(progress.iteration, running, self.policy_tasks)
            fired = None
            for planned in self.pending:
                target = self._target(planned, progress, running) if progress else None
                if target is not None:
                    fired = planned, target
                    break
            if fired is None:
                await asyncio.sleep(
                    FIRST_GENERATION_POLL_S if self._watching_first_generations(progress) else POLL_S
                )
                continue
            self.pending.remove(fired[0])
            await self._inject(*fired)

    def _watching_first_generations(self, progress) -> bool:
        """Whether a first-generation fault waits in the iteration running now: its window
        is a fraction of a second, so it is looked for more often."""
        return progress is not None and any(
            p.first_generation is not None and progress.iteration >= p.first_generation for p in self.pending
        )

    def settle(self) -> list[dict]:
        for planned in self.pending:
            self.faults.append(
                {
                    "kind": planned.fault,
                    "at": None,
                    "target": None,
                    "recovery_s": None,
                    "recovered_by": "not injected: the run finished first",
                }
            )
        self.pending = []
        return self.faults

    async def _progress(self):
        try:
            return await run_progress(self.client, self.run_id)
        except Exception:  # the run's worker is restarting, or Temporal is: ask again
            return None

    def _target(self, planned: PlannedFault, progress, running: list) -> tuple[str, object] | None:
        """What the fault hits now: ("trainer", None), ("the train step", None) for a run-wide
        fault that found no trajectory, or (trajectory id, its progress)."""
        if planned.t is not None:
            if time.monotonic() - self.started < planned.t:
                return None
        else:
            iteration = planned.iteration if planned.first_generation is None else planned.first_generation
            if iteration is None or progress.iteration < iteration:
                return None
        if planned.fault == "trainer-crash":
            return ("trainer", None) if progress.phase == "train" else None
        if self._waits_for_a_first_generation(planned, progress.iteration):
            return None
        for trajectory_id, seen in running:
            if seen.status == "running" and seen.sandbox and aimed_at(planned, seen, self.policy_tasks):
                return trajectory_id, seen
        if planned.fault in RUN_WIDE_FAULTS and progress.phase == "train":
            return ("the train step", None)
        return None

    def _waits_for_a_first_generation(self, planned: PlannedFault, iteration: int) -> bool:
        """A fault planned for iteration K, in iteration K, waits while a first-generation
        fault planned for K still has its chance ahead: fired first, its recovery would hold
        the injector longer than a first generation lasts, and in a run's last iteration the
        first-generation fault would be missed. Past K, neither waits for the other."""
        return (
            planned.iteration == iteration
            and not self.windows.past(iteration)
            and any(p.first_generation == iteration for p in self.pending)
        )

    async def _running(self, progress) -> list[tuple[str, object]]:
        """The iteration's running trajectories and what each is doing. Asked all at once:
        a first generation of the tiny model lasts a fraction of a second, shorter than
        asking a dozen trajectories one after another."""
        if progress is None or not progress.running:
            return []
        seen_all = await asyncio.gather(*(self._trajectory_progress(t) for t in progress.running))
        return [(t, seen) for t, seen in zip(progress.running, seen_all, strict=True) if seen is not None]

    async def _trajectory_progress(self, trajectory_id: str):
        try:
            return await trajectory_progress(self.client.get_workflow_handle(trajectory_id))
        except Exception:  # it is ending, or its worker is restarting
            return None

    async def _inject(self, planned: PlannedFault, target: tuple[str, object]) -> None:
        trajectory_id, seen = target
        progress = await self._progress()
        record = {
            "kind": planned.fault,
            "at": progress.iteration if progress else None,
            "target": trajectory_id,
            "recovered_by": None,
            "recovery_s": None,
        }
        self.faults.append(record)
        recoveries_before = recoveries_of(node_roles(self.config))
        container = seen.sandbox.container if seen is not None and seen.sandbox else None
        try:
            report = await asyncio.to_thread(
                self.chaos.inject,
                planned.fault,
                sandbox_container=container,
                node_queue=seen.node_queue if seen is not None else None,
            )
        except ChaosError as exc:
            if container and await asyncio.to_thread(self.chaos.container_gone, container):
                # the target ended between the look and the fault and its sandbox went with it:
                # aim again at whatever runs next, as a plan's "or the first chance after" says
                self.faults.remove(record)
                self.pending.insert(0, planned)
                return
            record["recovered_by"] = f"not injected: {exc}"
            self.say(f"fault {record['kind']}: {record['recovered_by']}")
            return
        record.update(
            target=report.target if seen is None else f"{trajectory_id} ({report.target})",
            detail=report.detail,
        )
        if seen is None:
            await self._until_trained(record["at"])
        else:
            await self._until_moves_on(trajectory_id, seen.step)
        record["recovery_s"] = round(time.time() - report.at, 3)
        record["recovered_by"] = self._recovered_by(planned.fault, recoveries_before)
        self.say(
            f"fault {record['kind']} in iteration {record['at']} on {record['target']}: "
            f"recovered by {record['recovered_by']} in {record['recovery_s']:.2f}s"
        )

    async def _until_moves_on(self, trajectory_id: str, step: int) -> None:
        while True:
            seen = await self._trajectory_progress(trajectory_id)
            if seen is not None and (seen.step > step or seen.status != "running"):
                return
            if seen is None and await self._closed(trajectory_id):
                return
            await asyncio.sleep(POLL_S)

    async def _until_trained(self, iteration: int | None) -> None:
        while True:
            progress = await self._progress()
            if progress is not None and (progress.phase != "train" or progress.iteration != iteration):
                return
            await asyncio.sleep(POLL_S)

    async def _closed(self, workflow_id: str) -> bool:
        try:
            described = await self.client.get_workflow_handle(workflow_id).describe()
        except Exception:
            return False
        return described.status != WorkflowExecutionStatus.RUNNING

    def _recovered_by(self, kind: str, recoveries_before: int) -> str:
        if kind.startswith(("engine", "owner")):
            roles = node_roles(self.config)
            if recoveries_of(roles) > recoveries_before:
                return roles.last_recovery.kind if roles.last_recovery else "takeover"
        return RECOVERED_BY[kind]


def aimed_at(planned: PlannedFault, seen, policy_tasks: frozenset[str]) -> bool:
    """Whether the running trajectory `seen` is what `planned` waits for: one past its first
    action (or `planned.step`), or with `first_generation` one of a task the policy acts in
    (`policy_tasks`), still at its first generation."""
    if planned.first_generation is not None:
        return seen.step == 0 and seen.task in policy_tasks
    return seen.step >= (planned.step or 1)


def policy_tasks_of(tasks) -> frozenset[str]:
    """The ids of the tasks the policy acts in: every kind but the scripted trace task."""
    return frozenset(t.id for t in tasks if not isinstance(t, TraceTask))


class FirstGenerationWindows:
    """Per iteration, whether the first generations of the tasks the policy acts in are
    over: a trajectory of one was seen past its first action, or seen at step 0 and then
    no longer running. Until then a first-generation fault may still find its target."""

    def __init__(self) -> None:
        self._at_first: dict[int, set[str]] = {}
        self._past: set[int] = set()

    def observe(
        self, iteration: int, running: list[tuple[str, object]], policy_tasks: frozenset[str]
    ) -> None:
        if iteration in self._past:
            return
        seen_at_first = self._at_first.setdefault(iteration, set())
        still_at_first = set()
        for trajectory_id, seen in running:
            if seen.task not in policy_tasks:
                continue
            if seen.step == 0 and seen.status == "running":
                still_at_first.add(trajectory_id)
            else:
                self._past.add(iteration)
        if seen_at_first - still_at_first:  # one seen at its first generation ended or moved on
            self._past.add(iteration)
        seen_at_first |= still_at_first

    def past(self, iteration: int) -> bool:
        return iteration in self._past
