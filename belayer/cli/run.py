"""`belayer run` and `belayer inspect`: start trajectories, follow them, look inside one."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.service import RPCError

from belayer.chaos.faults import RECOVERED_BY, Chaos, ChaosError, node_roles
from belayer.chaos.plan import parse_plan, random_plan
from belayer.cli.context import config_from
from belayer.client import (
    follow_trajectories,
    result_through_restarts,
    start_group,
    start_trajectory,
    trajectory_input,
    ui_link,
)
from belayer.contracts.sandbox import (
    CHECKPOINT,
    EXEC,
    PUBLISH_CHECKPOINT,
    CheckpointResult,
    ExecArgs,
    ExecResult,
)
from belayer.errors import BelayerError
from belayer.policy.adaptive import DecisionRecord, predictor_error
from belayer.rollout.status import NodeStatus
from belayer.sandbox.observations import load_observation
from belayer.storage.store import open_store
from belayer.temporal_client import connect
from belayer.trajectory_log import read_decisions
from belayer.workers.rollout.worker import generation_of, recoveries_of
from belayer.workflows.groups import GroupInput, cause_of
from belayer.workflows.models import TrajectoryResult
from belayer.workloads.harbor_tasks import runnable_workload
from belayer.workloads.registry import driver_for

console = Console(stderr=True)


@click.command()
@click.argument("workload", type=click.Path(path_type=Path))
@click.option(
    "-n",
    "--repeats",
    default=1,
    show_default=True,
    type=click.IntRange(1, 10_000),
    help="Trajectories per task.",
)
@click.option(
    "--concurrency",
    default=4,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Trajectories running at once.",
)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0), help="Sampling seed.")
@click.option(
    "--fork/--no-fork",
    "fork",
    default=True,
    show_default=True,
    help="With -n > 1, set up one sandbox per task and fork the task's trajectories from it "
    "(else each creates and sets up its own).",
)
@click.option(
    "--keep-checkpoints",
    is_flag=True,
    help="Keep the checkpoints (and each group's set-up checkpoint) when trajectories end, to branch "
    "from them later (`belayer fork`); the bucket's lifecycle rule expires them.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every trajectory.")
@click.option(
    "--chaos",
    "chaos_plan",
    default=None,
    metavar="PLAN",
    help="Inject real faults: a .yaml plan or e.g. 'engine-crash@step=2,sandbox-crash@step=4'.",
)
@click.option("--chaos-rate", type=float, default=None, help="Seeded random faults per step (0-1).")
@click.option("--chaos-seed", type=int, default=0, show_default=True, help="Seed of --chaos-rate.")
@click.option(
    "--agent",
    type=click.Choice(["model", "oracle", "nop"]),
    default="model",
    show_default=True,
    help="Harbor tasks: the policy (model), the task's solution/solve.sh (oracle: validates a dataset "
    "end to end) or nothing (nop: every sound task scores 0).",
)
@click.option(
    "--reward-key",
    default=None,
    metavar="KEY",
    help="Harbor tasks whose verifier writes only reward.json: the key that is the reward "
    "(default: its `reward` key, else the mean of its numeric values).",
)
@click.option(
    "--freeze-agent",
    is_flag=True,
    help="Harbor tasks: stop the agent's processes while the tests run (Harbor lets them run: a server "
    "the tests query needs it, but a process left running can also change what the tests read).",
)
@click.option(
    "--strict-network",
    is_flag=True,
    help="Refuse Harbor tasks that ask for network (sandboxes have none) instead of running them offline.",
)
@click.pass_context
def run(
    ctx: click.Context,
    workload: Path,
    repeats: int,
    concurrency: int,
    seed: int,
    fork: bool,
    keep_checkpoints: bool,
    as_json: bool,
    chaos_plan: str | None,
    chaos_rate: float | None,
    chaos_seed: int,
    agent: str,
    reward_key: str | None,
    strict_network: bool,
    freeze_agent: bool,
) -> None:
    """Run every task of WORKLOAD (.yaml or .jsonl, or a Harbor task directory or dataset)
    as durable trajectories.

    A Harbor task's image is built first (cached by its context), its reward is what its
    tests/test.sh wrote (any value; none is the agent's failure, reward 0).

    With -n G > 1 each task's G trajectories are a group: one sandbox is set up and
    checkpointed, the G sandboxes are forked from it (a group takes min(G, --concurrency)
    of the slots at once). Exit status 1 when any trajectory ended failed_infra. Ctrl-C
    leaves the trajectories running; follow them with `belayer inspect ID` or in the
    Temporal web UI.
    """

    config = config_from(ctx.find_root())
    progress = lambda line: console.print(f"  {line}", highlight=False, markup=False)  # noqa: E731 (stderr)
    tasks = runnable_workload(config, workload, agent=agent, reward_key=reward_key, strict_network=strict_network,
                              freeze_agent=freeze_agent, progress=progress).tasks  # fmt: skip
    plan = _chaos_plan(chaos_plan, chaos_rate, chaos_seed, tasks)
    started_at = time.monotonic()
    runner = _Runner(
        config,
        _inputs(config, tasks, repeats, seed, keep_checkpoints),
        concurrency,
        plan,
        groups=fork and repeats > 1,
    )
    try:
        results = asyncio.run(runner.run(quiet=as_json))
    except KeyboardInterrupt:
        console.print(
            "\n[yellow]interrupted[/]: the trajectories keep running on the workers. Follow them with"
        )
        for workflow_id in runner.started:
            console.print(f"  belayer inspect {workflow_id}")
        console.print(f"or in the web UI: {runner.ui_root()}")
        os._exit(130)
    wall = time.monotonic() - started_at
    _report(results, wall, as_json, runner.faults if plan else None, runner.group_records)
    failed_infra = any(r.status == "failed_infra" for r in results)
    sys.stdout.flush()
    # Exit without interpreter teardown: the Temporal SDK can abort at exit (docs/design.md §7).
    os._exit(1 if failed_infra else 0)


def _inputs(config, tasks, repeats: int, seed: int, keep_checkpoints: bool) -> list:
    run_id = uuid.uuid4().hex[:6]
    return [trajectory_input(config, task, repeat=repeat, seed=seed, run_id=run_id).model_copy(
                update={"keep_checkpoints": keep_checkpoints})
            for task in tasks for repeat in range(repeats)]  # fmt: skip


def _chaos_plan(plan: str | None, rate: float | None, seed: int, tasks) -> list:
    if plan and rate is not None:
        raise click.UsageError("give --chaos or --chaos-rate, not both")
    if plan:
        parsed = parse_plan(plan)
        training_only = [
            p.fault
            for p in parsed
            if p.iteration is not None or p.first_generation is not None or p.fault == "trainer-crash"
        ]
        if training_only:
            raise click.UsageError(
                f"{training_only[0]}: iteration and first-generation triggers and trainer-crash are for "
                "`belayer train --chaos`; trajectories take FAULT@step=N or FAULT@t=SECONDS"
            )
        return parsed
    if rate is not None:
        steps = max(_turns_of(t) for t in tasks)
        return random_plan(rate, seed, steps)
    return []


class _Runner:
    """Starts trajectories (or, with `groups`, one group per task), follows them, injects
    the chaos plan's faults; `belayer run` and `belayer fork`."""

    def __init__(
        self, config, inputs: list, concurrency: int, plan: list | None = None, *, groups: bool = False
    ):
        self.config = config
        self.plan = plan or []
        self.progress: dict[str, object] = {}
        self.finished: set[str] = set()
        self.faults: list[dict] = []
        self.inputs = inputs
        self.concurrency = concurrency
        self.groups = groups
        self.group_records: list = []
        self.started: list[str] = []
        self._slots_taken = asyncio.Lock()

    def ui_root(self) -> str:
        return ui_link(self.config, "").rstrip("/")

    async def run(self, quiet: bool):
        client = await connect(self.config.temporal, self.config.storage.encryption_key)
        limit = asyncio.Semaphore(self.concurrency)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            console=console,
            disable=quiet,
            transient=False,
        ) as progress:
            if self.groups:
                by_task: dict[str, list] = {}
                for item in self.inputs:
                    by_task.setdefault(item.task.id, []).append(item)
                jobs = [self._group(client, limit, progress, members) for members in by_task.values()]
            else:
                jobs = [self._one(client, limit, progress, item) for item in self.inputs]
            chaos = asyncio.ensure_future(self._chaos()) if self.plan else None
            results = await asyncio.gather(*jobs)
            if self.groups:
                results = [r for members in results for r in members]
            if chaos is not None:
                # every trajectory ended: pending faults settle as not injected, a measuring one
                # writes its record; only a fault still being injected is waited for
                try:
                    await asyncio.wait_for(asyncio.shield(chaos), 300)
                except TimeoutError:
                    chaos.cancel()
                await asyncio.gather(chaos, return_exceptions=True)
            self._settle_faults(results)
            return results

    async def _chaos(self) -> None:
        """Inject each planned fault when its trigger fires (step and time triggers are
        watched together; faults go one at a time); measure until the target moves on."""

        chaos = Chaos(self.config)
        started = time.monotonic()
        pending = list(self.plan)
        while pending:
            fired = None
            for planned in pending:
                target = self._target_of(planned)
                seen = self.progress.get(target)
                if target in self.finished or (
                    seen is not None
                    and (
                        planned.step is not None
                        and seen.step >= planned.step
                        or planned.t is not None
                        and time.monotonic() - started >= planned.t
                    )
                ):
                    fired = (planned, target, seen)
                    break
            if fired is None:
                await asyncio.sleep(0.1)
                continue
            planned, target, seen = fired
            pending.remove(planned)
            await self._inject(chaos, planned, target, seen)

    def _target_of(self, planned) -> str | None:
        """A trajectory id, or a task id (its first trajectory); default the first started."""
        if planned.target is None:
            return self.started[0] if self.started else None
        if planned.target in self.started:
            return planned.target
        ids = [i.trajectory_id for i in self.inputs if i.task.id == planned.target]
        return next((i for i in ids if i in self.started), ids[0] if ids else planned.target)

    async def _inject(self, chaos, planned, target, seen) -> None:
        record = {
            "kind": planned.fault,
            "at": None,
            "target": target,
            "recovered_by": None,
            "recovery_s": None,
            "trajectory": target,
        }
        self.faults.append(record)
        if target in self.finished or seen is None:
            record["recovered_by"] = "not injected: the target finished first"
            return
        roles_before = node_roles(self.config)
        container = seen.sandbox.container if seen.sandbox else None
        try:
            report = await asyncio.to_thread(
                chaos.inject, planned.fault, sandbox_container=container, node_queue=seen.node_queue
            )
        except ChaosError as exc:
            record["recovered_by"] = f"not injected: {exc}"
            return
        record.update(at=seen.step, target=report.target, detail=report.detail, injected_at=report.at)
        await self._measure_recovery(record, target, seen.step, report.at, chaos, roles_before)

    async def _measure_recovery(self, record, trajectory, step, injected_at, chaos, roles_before) -> None:
        """Recovery time = injection until the trajectory completes another step (or ends)."""
        while trajectory not in self.finished:
            seen = self.progress.get(trajectory)
            if seen is not None and seen.step > step:
                break
            await asyncio.sleep(0.1)
        record["recovery_s"] = round(time.time() - injected_at, 3)
        roles_after = node_roles(self.config)
        if record["kind"].startswith(("engine", "owner")) and recoveries_of(roles_after) > recoveries_of(
            roles_before
        ):
            event = roles_after.last_recovery
            record["recovered_by"] = event.kind if event else "takeover"
            record["node_ready_s"] = event.ready_s if event else None
        if record["kind"] == "owner-crash":
            record["protected_again_s"] = await _protected_again_s(self.config, roles_before)
            record["recovered_by"] = (
                "a new owner adopted the verified segments (takeover possible again)"
                if record["protected_again_s"] is not None
                else "not protected again"
            )
        record.setdefault("_trajectory", trajectory)

    def _settle_faults(self, results) -> None:
        """Name what recovered each fault, from what the trajectories recorded."""
        by_id = {r.trajectory_id: r for r in results}
        for record in self.faults:
            trajectory = by_id.get(record.pop("_trajectory", record["target"]))
            if record["recovered_by"] is not None:
                continue
            restored = trajectory is not None and bool(trajectory.recoveries)
            if record["kind"] in ("sandbox-crash", "sandbox-host-crash") and not restored:
                record["recovered_by"] = "retry"
            else:
                record["recovered_by"] = RECOVERED_BY.get(record["kind"], "retry")

    async def _group(self, client, limit, progress, members):
        """One task's group as a TrajectoryGroupWorkflow; its members followed by their ids."""

        rows = {m.trajectory_id: progress.add_task(m.trajectory_id, total=_turns_of(m.task), note="waiting")
                for m in members}  # fmt: skip
        slots = min(len(members), self.concurrency)
        async with self._slots_taken:  # whole groups at a time: two half-served groups would wait forever
            for _ in range(slots):
                await limit.acquire()
        try:
            group = GroupInput(group_id=f"group-{members[0].trajectory_id}", members=members,
                               workflow_queue=self.config.temporal.workflow_task_queue)  # fmt: skip
            handle = await start_group(client, self.config, group)
            self.started += [m.trajectory_id for m in members]
            done = await self._follow(client, handle, rows, progress)
        finally:
            for _ in range(slots):
                limit.release()
        self.group_records.append(done.group)
        for result in done.results:
            self.finished.add(result.trajectory_id)
            progress.update(
                rows[result.trajectory_id],
                completed=_turns_of(members[0].task),
                note=f"{result.status}, reward {result.reward}",
            )
        return done.results

    async def _follow(self, client, handle, rows, progress):
        """Wait for a workflow's result, showing its trajectories' progress meanwhile."""

        # a restarted Temporal server (chaos: temporal-restart) drops the long poll: asked again
        async for seen in follow_trajectories(handle, [client.get_workflow_handle(t) for t in rows]):
            self.progress[seen.trajectory_id] = seen
            recoveries = f", {len(seen.recoveries)} recoveries" if seen.recoveries else ""
            progress.update(
                rows[seen.trajectory_id],
                completed=seen.step,
                note=f"step {seen.step}, {seen.tokens} tokens{recoveries}",
            )
        return await result_through_restarts(handle)

    def _closed_without_result(self, input, err: WorkflowFailureError) -> TrajectoryResult:
        """A trajectory whose workflow closed with no result of its own (terminated from the
        Temporal UI or CLI, timed out): no reward, as for any failure that is not the agent's."""
        seen = self.progress.get(input.trajectory_id)
        return TrajectoryResult(
            trajectory_id=input.trajectory_id, task=input.task.id, status="failed_infra",
            reason=f"its workflow closed without a result: {cause_of(err)}",
            turns=seen.step if seen else 0, tokens=seen.tokens if seen else 0, reward=None, token_sha256=None,
            env_sha256=None, recoveries=list(seen.recoveries) if seen else [], checkpoints=0,
        )  # fmt: skip

    async def _one(self, client, limit, progress, input):
        total = _turns_of(input.task)
        row = progress.add_task(input.trajectory_id, total=total, note="waiting")
        async with limit:
            handle = await start_trajectory(client, self.config, input)
            self.started.append(input.trajectory_id)
            try:
                result = await self._follow(client, handle, {input.trajectory_id: row}, progress)
            except WorkflowFailureError as err:
                result = self._closed_without_result(input, err)
            self.finished.add(input.trajectory_id)
            progress.update(row, completed=total, note=f"{result.status}, reward {result.reward}")
            return result


def _turns_of(task) -> int:
    return driver_for(task).turn_limit(task)


# What a recovered turn's replay says of the tokens it kept, as `belayer run` prints it.
REPLAY_VERDICTS = {
    "same": "the same tokens",
    "differs": "[yellow]other tokens[/] (a near-tie flipped)",
    "not_compared": "not compared",
}


def _after_recovery(result) -> dict:
    """What `--json` says of the tokens an engine recovery may have changed: nothing when
    no recovery interrupted a turn."""
    if not result.recovered_turns:
        return {}
    return {
        "tokens_after_recovery": result.tokens_after_recovery,
        "recovered_turns": [turn.model_dump(mode="json") for turn in result.recovered_turns],
        "recovered_tokens_differ": result.recovered_tokens_differ,
    }


def _report(
    results, wall: float, as_json: bool, faults: list[dict] | None = None, groups: list | None = None
) -> None:
    rows = [
        {
            "id": r.trajectory_id,
            "task": r.task,
            "status": r.status,
            "turns": r.turns,
            "tokens": r.tokens,
            "reward": r.reward,
            "token_sha256": r.token_sha256,
            "env_sha256": r.env_sha256,
            "context": r.context.model_dump(mode="json") if r.context else None,  # the token log
            "recoveries": [rec.model_dump() for rec in r.recoveries],
            **({"reason": r.reason} if r.reason else {}),
            **(
                {"rewards": r.rewards, "verifier_logs": r.verifier_logs}
                if r.rewards or r.verifier_logs
                else {}
            ),
            **({"artifacts": r.artifacts} if r.artifacts else {}),
            **({"notes": r.notes} if r.notes else {}),
            **({"disk_bytes": r.disk_bytes} if r.disk_bytes is not None else {}),
            **_after_recovery(r),
        }
        for r in results
    ]
    if as_json:
        report = {"trajectories": rows, "wall_s": round(wall, 3)}
        if faults is not None:
            report["faults"] = faults
        if groups:
            report["groups"] = [
                g.model_dump(mode="json", exclude={"origin", "setup_sandbox"}) for g in groups
            ]
        click.echo(json.dumps(report, indent=2))
        return
    table = Table(
        "trajectory",
        "status",
        "turns",
        "tokens",
        "reward",
        "recoveries",
        "checkpoints",
        "token sha256",
        "env sha256",
    )
    for r in results:
        status = {"completed": "[green]completed[/]", "failed_infra": "[red]failed_infra[/]"}.get(
            r.status, r.status
        )
        table.add_row(
            r.trajectory_id,
            status,
            str(r.turns),
            str(r.tokens),
            str(r.reward),
            str(len(r.recoveries)),
            str(r.checkpoints),
            (r.token_sha256 or "-")[:12],
            (r.env_sha256 or "-")[:12],
        )
    Console(width=max(Console().width, 160)).print(table)
    for r in results:
        for rec in r.recoveries:
            cut = f", context cut after step {rec.cut_after_step}" if rec.cut_after_step else ""
            console.print(
                f"  {r.trajectory_id}: {rec.kind} recovery at step {rec.step} from {rec.source}, "
                f"{rec.replayed_steps} steps replayed, {rec.time_lost_s:.2f}s lost{cut}"
            )
        for turn in r.recovered_turns:
            replay = turn.replay
            console.print(
                f"  {r.trajectory_id}: turn {turn.turn} recovered after its token {replay.position}; "
                f"replayed uninterrupted: {REPLAY_VERDICTS[replay.outcome]}"
                f"{f' ({replay.detail})' if replay.detail else ''}; "
                f"{r.tokens_after_recovery} tokens generated after the recovery"
            )
        if r.reason:
            console.print(f"  {r.trajectory_id}: {r.reason}")
        if len(r.rewards) > 1:
            console.print(f"  {r.trajectory_id}: rewards {r.rewards}")
        for note in r.notes:
            console.print(f"  {r.trajectory_id}: [yellow]note[/]: {note}")
    for group in groups or []:
        if group.forked:
            console.print(
                f"  group {group.task}: {group.forked} of {group.size} sandboxes forked from one set-up "
                f"sandbox, ready {group.ready_s:.2f}s after the group started (setup {group.setup_s:.2f}s, "
                f"checkpoint {group.checkpoint_s:.2f}s, forks {group.fork_s:.2f}s)"
            )
        for line in ([group.fallback] if group.fallback else []) + group.notes:
            console.print(f"  group {group.task}: {line}")
    for fault in faults or []:
        took = f" in {fault['recovery_s']:.2f}s" if fault.get("recovery_s") is not None else ""
        console.print(
            f"  fault {fault['kind']} at step {fault['at']} on {fault['target']}: "
            f"recovered by {fault['recovered_by']}{took}"
        )
    console.print(f"{len(results)} trajectories in {wall:.1f}s")


@click.command()
@click.argument("workflow_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def inspect(ctx: click.Context, workflow_id: str, as_json: bool) -> None:
    """Show a trajectory's turns, actions, observations, checkpoints and recoveries."""
    config = config_from(ctx.find_root())
    report = asyncio.run(_inspect(config, workflow_id))
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_inspection(report)
    sys.stdout.flush()
    os._exit(0)


async def _inspect(config, workflow_id: str) -> dict:
    client = await connect(config.temporal, config.storage.encryption_key)
    handle = client.get_workflow_handle(workflow_id)
    try:
        description = await handle.describe()
    except RPCError as exc:
        raise BelayerError(
            f"no trajectory {workflow_id!r} in namespace {config.temporal.namespace} ({exc}); "
            "list them with the web UI or `temporal workflow list`"
        ) from None

    steps, checkpoints, summary = await _walk_history(
        handle, client.data_converter, open_store(config.storage)
    )
    return {
        "id": workflow_id,
        "status": description.status.name if description.status else "?",
        "ui": ui_link(config, workflow_id),
        "steps": steps,
        "checkpoints": checkpoints,
        **summary,
    }


async def _walk_history(handle, converter, store):
    """Actions and observations as the history recorded them (works for closed runs too);
    `converter` is the client's, so encrypted payloads are decoded too; observations and
    the decision log are read from `store`, where the workers wrote them."""

    scheduled: dict[int, tuple[str, object]] = {}
    steps, checkpoints, summary = [], [], {}
    clock = _ActivityClock()
    async for event in handle.fetch_history_events():
        clock.see(event)
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            name = attrs.activity_type.name
            arg = None
            if name == EXEC.name and attrs.input.payloads:
                arg = (await converter.decode(attrs.input.payloads, [ExecArgs]))[0]
            scheduled[event.event_id] = (name, arg)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            attrs = event.activity_task_completed_event_attributes
            name, arg = scheduled.get(attrs.scheduled_event_id, ("?", None))
            if name == EXEC.name:
                ref = (await converter.decode(attrs.result.payloads, [ExecResult]))[0].observation
                obs = await asyncio.to_thread(load_observation, store, ref)
                steps.append(
                    {
                        "step": arg.action.step,
                        "command": arg.action.command,
                        "exit_code": obs.exit_code,
                        "stdout": obs.stdout[:300],
                        "stderr": obs.stderr[:300],
                        "duration_s": round(obs.duration_s, 3),
                        "replayed": obs.replayed_from_journal,
                    }
                )
            elif name in (CHECKPOINT.name, PUBLISH_CHECKPOINT.name):
                ref = (await converter.decode(attrs.result.payloads, [CheckpointResult]))[0].checkpoint
                checkpoints.append({"step": ref.step, "bytes": ref.archive_bytes, "key": ref.meta_key})
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            payloads = event.workflow_execution_completed_event_attributes.result.payloads
            if payloads:
                result = (await converter.decode(payloads, [TrajectoryResult]))[0]
                decisions = await asyncio.to_thread(read_decisions, store, result.log) if result.log else []
                summary = {"result": result.model_dump(), "decisions": [d.model_dump() for d in decisions]}
                if result.verifier_observation is not None:
                    summary["verifier"] = await asyncio.to_thread(_verifier_report, store, result)
    waits = sum(d.get("wait_s") or 0.0 for d in summary.get("decisions", []))
    summary["timing"] = clock.summary(turns=len(steps), checkpoint_wait_s=waits)
    return steps, checkpoints, summary


class _ActivityClock:
    """Where a trajectory's wall time went, from the history's own timestamps.

    Work = time activities on the critical path spent executing (started -> closed);
    checkpoints run beside generation and action, so only the waits for them count. The rest is
    orchestration: Temporal dispatch (scheduled -> started) and workflow task rounds.
    """

    OVERLAPPED = {"sandbox.checkpoint", "sandbox.capture_checkpoint", "sandbox.publish_checkpoint"}

    def __init__(self):
        self.first = self.last = None
        self.scheduled: dict[int, tuple[str, float]] = {}
        self.started: dict[int, float] = {}
        self.busy: dict[str, float] = {}
        self.dispatch_s = 0.0

    def see(self, event) -> None:
        at = event.event_time.ToDatetime().timestamp()
        self.first = at if self.first is None else self.first
        self.last = at
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            self.scheduled[event.event_id] = (name, at)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            scheduled_id = event.activity_task_started_event_attributes.scheduled_event_id
            self.started[scheduled_id] = at
        elif kind in (
            EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
        ):
            attrs = (
                event.activity_task_completed_event_attributes
                if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                else event.activity_task_failed_event_attributes
                if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
                else event.activity_task_timed_out_event_attributes
            )
            name, scheduled_at = self.scheduled.get(attrs.scheduled_event_id, ("?", at))
            started_at = self.started.get(attrs.scheduled_event_id, scheduled_at)
            self.busy[name] = self.busy.get(name, 0.0) + (at - started_at)
            if name not in self.OVERLAPPED:
                self.dispatch_s += started_at - scheduled_at

    def summary(self, turns: int, checkpoint_wait_s: float = 0.0) -> dict:
        wall = (self.last - self.first) if self.first is not None else 0.0
        work = sum(v for k, v in self.busy.items() if k not in self.OVERLAPPED)
        orchestration = max(0.0, wall - work - checkpoint_wait_s)
        return {
            "wall_s": round(wall, 3),
            "activity_s": {k: round(v, 3) for k, v in sorted(self.busy.items())},
            "critical_work_s": round(work, 3),
            "checkpoint_wait_s": round(checkpoint_wait_s, 3),
            "orchestration_s": round(orchestration, 3),
            "dispatch_s": round(self.dispatch_s, 3),
            "orchestration_per_turn_s": round(orchestration / turns, 4) if turns else None,
            "orchestration_pct": round(100 * orchestration / wall, 2) if wall else None,
        }


VERIFIER_SHOWN_CHARS = 4000


def _verifier_report(store, result: TrajectoryResult) -> dict:
    """A graded check's output and the files of its logs directory (a Harbor task's
    /logs/verifier), read back from the store, each cut to its last few thousand characters."""
    obs = load_observation(store, result.verifier_observation)
    logs = {name: store.get_bytes(key).decode("utf-8", "replace")[-VERIFIER_SHOWN_CHARS:]
            for name, key in result.verifier_logs.items()}  # fmt: skip
    return {"exit_code": obs.exit_code, "timed_out": obs.timed_out, "stdout": obs.stdout[-VERIFIER_SHOWN_CHARS:],
            "stderr": obs.stderr[-VERIFIER_SHOWN_CHARS:], "logs": logs, "rewards": result.rewards}  # fmt: skip


def _print_inspection(report: dict) -> None:
    out = Console(width=max(Console().width, 160))
    out.print(f"[bold]{report['id']}[/]  {report['status']}  {report['ui']}")
    table = Table("step", "command", "exit", "observation (truncated)", "s")
    for step in report["steps"]:
        text = (step["stdout"] + step["stderr"]).strip().replace("\n", " ⏎ ")[:80]
        table.add_row(
            str(step["step"]),
            step["command"].strip().splitlines()[0][:50],
            str(step["exit_code"]),
            text,
            str(step["duration_s"]),
        )
    out.print(table)
    if report["checkpoints"]:
        out.print(
            "checkpoints: "
            + ", ".join(f"step {c['step']} ({c['bytes'] // 1024} KiB)" for c in report["checkpoints"])
        )
    timing = report.get("timing")
    if timing:
        out.print(
            f"time: {timing['wall_s']}s wall, {timing['critical_work_s']}s engine/sandbox/context work, "
            f"{timing['orchestration_s']}s orchestration ({timing['orchestration_pct']}%, "
            f"{timing['orchestration_per_turn_s']}s per turn)"
        )
    result = report.get("result")
    if result:
        out.print(
            f"result: {result['status']} reward={result['reward']} turns={result['turns']} "
            f"tokens={result['tokens']}"
        )
        broken = result.get("sandbox_broken")
        if broken:
            out.print(
                f"  [red]the agent broke its sandbox at step {broken['step']}[/] ({broken['cause']}): "
                f"{broken['detail'][:200]}"
            )
        elif result.get("reason"):
            out.print(f"  reason: {result['reason'][:300]}")
        for rec in result["recoveries"]:
            out.print(
                f"  recovery at step {rec['step']}: {rec['reason'][:80]} → {rec['source']}, "
                f"replayed {rec['replayed_steps']}, consistent={rec['consistent']}"
            )
    verifier = report.get("verifier")
    if verifier:
        timed_out = ", timed out" if verifier["timed_out"] else ""
        out.print(f"verifier: exit {verifier['exit_code']}{timed_out}, rewards {verifier['rewards']}")
        for stream in ("stdout", "stderr"):
            if verifier[stream].strip():
                out.print(f"  {stream}:", escape(verifier[stream].rstrip()[-1500:]), highlight=False)
        for name, text in verifier["logs"].items():
            out.print(f"  /logs/verifier/{name}:", escape(text.rstrip()[-1500:]), highlight=False)
    if report.get("decisions"):

        def secs(value) -> str:
            return "-" if value is None else f"{value:.2f}"

        decisions = [DecisionRecord(**d) for d in report["decisions"]]
        table = Table(
            "step",
            "verdict",
            "gen predicted",
            "gen actual",
            "ckpt estimated",
            "ckpt actual",
            "wait",
            "unprotected",
            "reason",
            title="checkpoint decisions (s)",
        )
        for d in decisions:
            table.add_row(
                str(d.step),
                d.verdict,
                secs(d.predicted_generation_s),
                secs(d.actual_generation_s),
                secs(d.estimated_checkpoint_s),
                secs(d.actual_checkpoint_s),
                secs(d.wait_s),
                str(d.unprotected_steps),
                d.reason[:60],
            )
        out.print(table)
        error = predictor_error(decisions)
        out.print(
            f"predictor error (mean relative): generation {secs(error['generation_mean_rel_error'])}, "
            f"checkpoint {secs(error['checkpoint_mean_rel_error'])}"
        )


async def _protected_again_s(
    config, roles_before: NodeStatus | None, timeout_s: float = 180.0
) -> float | None:
    """Owner death -> the node can take over again, as the node measured it; None if it was
    not protected again within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = node_roles(config)
        after = now.last_owner_recovery if now else None
        if after and after.owner_generation > generation_of(roles_before):
            return after.protected_again_s
        await asyncio.sleep(0.2)
    return None
