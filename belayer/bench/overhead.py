"""`belayer bench overhead`: what checkpointing costs while nothing fails, and what it saves
when a sandbox dies, under each checkpoint policy, in one run.

The same trace workload runs as real trajectories against the running stack (Temporal,
rollout node, sandbox worker) under `none`, `every-step`, `adaptive` and `adaptive-model`.
`adaptive` is told each coming generation's length by the trace, an oracle a model task
does not have; `adaptive-model` is the same policy blind to it (`trace_lengths_known`
off), predicting each generation from the ones before as on a model task, while the
generations themselves stay the trace's, so both run the same reproducible work. The
modes are interleaved — round r runs them in an order rotated by r — so drift on a shared
machine (other jobs, a warming cache) lands on every mode alike. With `--inject-failure`
each round also runs each mode once more with its sandbox SIGKILLed at a chosen step, and
the time lost per failure is the faulted run's wall time minus the same mode's
failure-free mean: overhead and recovery in one table.

Per-phase figures come from the trajectories' own decision records (generation, action,
checkpoint and wait durations). From them `accelerator_estimate` replays the trace through
`belayer.policy.simulate`, i.e. the workflow's overlap rule without CPU contention between
the engine and the checkpoint: the figure this trace would show with the engine on its
own accelerator. Before it, `simulator_check` replays each mode's own measured phases
through the same rule and gives its error against that mode's measured overhead, and
`none_spread_pct` says how far the `none` runs differ among themselves (`rounds_enough`:
less than the 3 % goal, so the rounds can resolve it). Scheduling and summarising are pure functions; only `run_trial` talks
to the stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from belayer.chaos.faults import Chaos
from belayer.client import follow_trajectories, start_trajectory, trajectory_input
from belayer.measure import goals, spread, spread_cells
from belayer.policy.adaptive import DecisionRecord, predictor_error
from belayer.policy.config import PolicyConfig
from belayer.policy.simulate import TraceStep, simulate
from belayer.storage.store import open_store
from belayer.trajectory_log import read_decisions
from belayer.workflows.models import RecoveryRecord, TrajectoryInput, TrajectoryResult
from belayer.workloads.loader import load_workload
from belayer.workloads.models import TraceTask

MODES = ("none", "every-step", "adaptive", "adaptive-model")
KEY = {"none": "none", "every-step": "every_step", "adaptive": "adaptive", "adaptive-model": "adaptive_model"}
CHECKPOINTING = MODES[1:]  # the modes whose overhead is measured against `none`
DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "overhead.yaml"
GOAL_OVERHEAD_PCT = 3.0  # adaptive checkpointing's failure-free overhead on model tasks


class Trial(BaseModel):
    """One trajectory of the benchmark: its round, policy mode and whether it is faulted."""

    round: int
    mode: str
    faulted: bool = False


class TrialResult(Trial):
    """What one trajectory measured."""

    trajectory_id: str
    status: str
    reason: str = ""
    wall_s: float
    checkpoints: int
    decisions: list[DecisionRecord]
    recoveries: list[RecoveryRecord]
    fault_step: int | None = None
    fault_detail: str | None = None


@dataclass
class Target:
    """Where trials run: how to start a trajectory and how to kill its sandbox."""

    start: Callable[[TrajectoryInput], Awaitable]  # -> temporalio WorkflowHandle
    make_input: Callable[[TraceTask, PolicyConfig, str], TrajectoryInput]
    kill_sandbox: Callable[[str], str]  # container name -> what was done
    store: Any  # the object store the trajectories log their decisions to


# ---------------------------------------------------------------- schedule


def schedule(rounds: int, inject: bool) -> list[Trial]:
    """Round r runs every (mode, faulted) pair once, in an order rotated by r."""
    pairs = [(m, False) for m in MODES] + ([(m, True) for m in MODES] if inject else [])
    trials = []
    for r in range(rounds):
        k = r % len(pairs)
        trials += [Trial(round=r, mode=m, faulted=f) for m, f in pairs[k:] + pairs[:k]]
    return trials


def mode_policy(policy: PolicyConfig, mode: str) -> PolicyConfig:
    """The policy a bench mode runs: `adaptive-model` is `adaptive` blind to the trace's
    generation lengths; every other mode is told them, whatever the configuration says."""
    if mode == "adaptive-model":
        return policy.model_copy(update={"mode": "adaptive", "trace_lengths_known": False})
    return policy.model_copy(update={"mode": mode, "trace_lengths_known": True})


def default_fail_step(task: TraceTask) -> int:
    """Two thirds of the way in: enough work behind it for the modes to differ."""
    return max(1, (2 * len(task.turns)) // 3)


# ---------------------------------------------------------------- running


async def run_trial(
    target: Target, task: TraceTask, policy: PolicyConfig, trial: Trial, *, fail_at: int, run_id: str
) -> TrialResult:
    """Run one trajectory to its end; when faulted, kill its sandbox once it reaches `fail_at`."""
    suffix = "-fault" if trial.faulted else ""
    trajectory_id = f"{task.id}-{run_id}-r{trial.round}-{trial.mode}{suffix}"
    input = target.make_input(task, mode_policy(policy, trial.mode), trajectory_id)
    started = time.monotonic()
    handle = await target.start(input)
    fault_step = fault_detail = None
    if trial.faulted:
        fault_step, fault_detail = await _kill_at_step(handle, target, fail_at)
    result: TrajectoryResult = await handle.result()
    wall = time.monotonic() - started
    decisions = await asyncio.to_thread(read_decisions, target.store, result.log) if result.log else []
    return TrialResult(
        **trial.model_dump(),
        trajectory_id=trajectory_id,
        status=result.status,
        reason=result.reason,
        wall_s=round(wall, 3),
        checkpoints=result.checkpoints,
        decisions=decisions,
        recoveries=result.recoveries,
        fault_step=fault_step,
        fault_detail=fault_detail,
    )


async def _kill_at_step(handle, target: Target, step: int) -> tuple[int | None, str]:
    """SIGKILL the sandbox as soon as action `step` is under way (or say why not)."""
    async with contextlib.aclosing(follow_trajectories(handle, every_s=0.1)) as following:
        async for seen in following:
            if seen.status != "running":
                break
            if seen.step >= step and seen.sandbox is not None:
                detail = await asyncio.to_thread(target.kill_sandbox, seen.sandbox.container)
                return seen.step, detail
    return None, "not injected: the trajectory ended first"


async def run_bench(
    target: Target,
    task: TraceTask,
    policy: PolicyConfig,
    *,
    rounds: int,
    inject: bool,
    fail_at: int | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> dict:
    """Every trial of the schedule, one after another, then the summary."""
    fail_at = fail_at or default_fail_step(task)
    run_id = uuid.uuid4().hex[:6]
    results = []
    for trial in schedule(rounds, inject):
        result = await run_trial(target, task, policy, trial, fail_at=fail_at, run_id=run_id)
        results.append(result)
        say(
            f"round {trial.round} {trial.mode:14s}{' faulted' if trial.faulted else '        '} "
            f"{result.wall_s:7.1f}s {result.status}, {result.checkpoints} checkpoints, "
            f"{len(result.recoveries)} recoveries  ({result.trajectory_id})"
        )
    return summarize(task, policy, results, rounds=rounds, fail_at=fail_at if inject else None)


# ---------------------------------------------------------------- summarising (pure)


def summarize(
    task: TraceTask,
    policy: PolicyConfig,
    results: list[TrialResult],
    *,
    rounds: int,
    fail_at: int | None = None,
) -> dict:
    """The benchmark's JSON: wall times, overheads, checkpoints, phases, failures, estimate.

    The top-level `*_s` and `*_overhead_pct` figures are means over the failure-free runs;
    `wall_s` and `overhead_pct` give min / median / max over the rounds (an overhead is a
    round's run against the same round's `none`). `adaptive` figures are the policy told
    the trace's generation lengths; `adaptive_model` and `*_model` ones are the same policy
    predicting them from history."""
    clean = {
        m: [r for r in results if r.mode == m and not r.faulted and r.status == "completed"] for m in MODES
    }
    walls = {m: _mean([r.wall_s for r in clean[m]]) for m in MODES}
    none_s = walls["none"]
    per_round = _per_round(results)
    report: dict = {
        "none_s": _round(none_s),
        "every_step_s": _round(walls["every-step"]),
        "adaptive_s": _round(walls["adaptive"]),
        "adaptive_model_s": _round(walls["adaptive-model"]),
        "every_step_overhead_pct": _pct(walls["every-step"], none_s),
        "adaptive_overhead_pct": _pct(walls["adaptive"], none_s),
        "adaptive_overhead_pct_model": _pct(walls["adaptive-model"], none_s),
        "checkpoints": {KEY[m]: _round(_mean([r.checkpoints for r in clean[m]]), 2) for m in CHECKPOINTING},
        "max_unprotected_steps": _max_unprotected(clean["adaptive"]),
        "max_unprotected_steps_model": _max_unprotected(clean["adaptive-model"]),
        "max_unprotected_replay_s": _max_unprotected_replay(clean["adaptive"]),
        "max_unprotected_replay_s_model": _max_unprotected_replay(clean["adaptive-model"]),
        "wall_s": {KEY[m]: spread([r.wall_s for r in clean[m]]) for m in MODES},
        "overhead_pct": {
            KEY[m]: spread([row.get(f"{KEY[m]}_overhead_pct") for row in per_round], digits=2)
            for m in CHECKPOINTING
        },
        "workload": task.id,
        "turns": len(task.turns),
        "think_tokens": sum(t.think_tokens for t in task.turns),
        "rounds": rounds,
        "policy": policy.model_dump(include={"alpha", "max_unprotected_steps", "max_unprotected_replay_s"}),
        "per_round": per_round,
        "phases": {KEY[m]: _phases(task, clean[m], clean["none"]) for m in MODES},
        "none_spread_pct": _none_spread_pct(clean["none"]),
        # the simulator checked against the runs it can be checked against, before its estimate
        "simulator_check": simulator_check(task, policy, clean),
        "accelerator_estimate": accelerator_estimate(task, policy, clean),
    }
    spread_pct = report["none_spread_pct"]
    report["rounds_enough"] = spread_pct is not None and spread_pct < GOAL_OVERHEAD_PCT
    model_pct = report["adaptive_overhead_pct_model"]
    report.update(goals({
        f"adaptive checkpointing on model tasks costs <= {GOAL_OVERHEAD_PCT:g} % failure-free "
        "(adaptive_overhead_pct_model)": model_pct is not None and model_pct <= GOAL_OVERHEAD_PCT,
    }))  # fmt: skip
    # The part of the overhead that is waiting for a checkpoint on the critical path; the
    # rest is the checkpoint's CPU slowing the engine, plus noise.
    report["wait_overhead_pct"] = {
        KEY[m]: _pct((none_s or 0) + (report["phases"][KEY[m]]["wait_s_per_trajectory"] or 0), none_s)
        for m in CHECKPOINTING
    }
    incomplete = [
        {"id": r.trajectory_id, "status": r.status, "reason": r.reason}
        for r in results
        if r.status != "completed"
    ]
    if incomplete:
        report["incomplete"] = incomplete
    if fail_at is not None:
        report["failures"] = _failures(results, walls, fail_at)
    return report


def _per_round(results: list[TrialResult]) -> list[dict]:
    rows = []
    for r in sorted({t.round for t in results}):
        this = [t for t in results if t.round == r]
        row: dict = {"order": [t.mode + ("+fault" if t.faulted else "") for t in this]}
        walls = {t.mode: t.wall_s for t in this if not t.faulted and t.status == "completed"}
        for m in MODES:
            row[f"{KEY[m]}_s"] = walls.get(m)
        if "none" in walls:
            for m in CHECKPOINTING:
                if m in walls:
                    row[f"{KEY[m]}_overhead_pct"] = _pct(walls[m], walls["none"])
        rows.append(row)
    return rows


def _turn_tokens(task: TraceTask, decision: DecisionRecord) -> int | None:
    """Think tokens of the generation that followed `decision` (the next turn's)."""
    return task.turns[decision.step].think_tokens if decision.step < len(task.turns) else None


def action_durations(decisions: list[DecisionRecord]) -> dict[int, float]:
    """Each action's duration, recovered from the unprotected replay time each decision saw:
    it restarts from zero after a checkpoint and accumulates over skipped steps."""
    out, carried = {}, 0.0
    for d in decisions:
        out[d.step] = max(d.unprotected_replay_s - carried, 0.0)
        carried = 0.0 if d.checkpointed else d.unprotected_replay_s
    return out


def _phases(task: TraceTask, trials: list[TrialResult], baseline: list[TrialResult]) -> dict:
    decisions = [d for t in trials for d in t.decisions]
    gens = [d.actual_generation_s for d in decisions if d.actual_generation_s is not None]
    tokens = [_turn_tokens(task, d) for d in decisions if d.actual_generation_s is not None]
    per_token = sum(gens) / sum(t or 0 for t in tokens) if gens and sum(t or 0 for t in tokens) else None
    base = [d for t in baseline for d in t.decisions if d.actual_generation_s is not None]
    base_tokens = sum(_turn_tokens(task, d) or 0 for d in base)
    base_per_token = sum(d.actual_generation_s for d in base) / base_tokens if base_tokens else None
    checkpoints = [d for d in decisions if d.actual_checkpoint_s is not None]
    waits = [d.wait_s for d in checkpoints if d.wait_s is not None]
    actions = [s for t in trials for s in action_durations(t.decisions).values()]
    errors = [predictor_error(t.decisions) for t in trials]
    n = len(trials) or None
    return {
        "trajectories": len(trials),
        "generation_s_per_turn": _round(_mean(gens)),
        "generation_ms_per_token": _round(per_token * 1000 if per_token else None, 2),
        "generation_slowdown_pct": _pct(per_token, base_per_token),
        "action_s_per_turn": _round(_mean(actions)),
        "checkpoint_s": _round(_mean([d.actual_checkpoint_s for d in checkpoints])),
        "checkpoint_mb": _round(
            _mean([d.actual_checkpoint_mb for d in checkpoints if d.actual_checkpoint_mb is not None]), 2
        ),
        "wait_s_per_trajectory": _round(sum(waits) / n if n else None),
        "waited_checkpoints_per_trajectory": _round(sum(1 for w in waits if w > 0.05) / n if n else None, 2),
        "verdicts": {
            v: sum(1 for d in decisions if d.verdict == v) for v in ("checkpoint", "forced", "skip")
        },
        "max_unprotected_steps": _max_unprotected(trials),
        "max_unprotected_replay_s": _max_unprotected_replay(trials),
        "predictor_error": {
            key: _round(_mean([e[key] for e in errors if e[key] is not None]), 3)
            for key in ("generation_mean_rel_error", "checkpoint_mean_rel_error")
        },
    }


def _failures(results: list[TrialResult], clean_walls: dict, fail_at: int) -> dict:
    """Per mode: end-to-end time lost per failure, and how the workflow recovered."""
    out = {}
    for m in MODES:
        faulted = [r for r in results if r.mode == m and r.faulted]
        hit = [r for r in faulted if r.fault_step is not None]
        lost = [
            r.wall_s - clean_walls[m] for r in hit if r.status == "completed" and clean_walls[m] is not None
        ]
        recs = [rec for r in hit for rec in r.recoveries]
        out[KEY[m]] = {
            "injected": len(hit),
            "fail_at_step": fail_at,
            "completed": sum(1 for r in hit if r.status == "completed"),
            "lost_s_per_failure": _round(_mean(lost)),
            "recovery_s": _round(_mean([rec.time_lost_s for rec in recs])),
            "replayed_steps": _round(_mean([rec.replayed_steps for rec in recs]), 2),
            "sources": sorted({rec.source for rec in recs}),
            "consistent": all(rec.consistent for rec in recs) if recs else None,
        }
    return out


def _max_unprotected(trials: list[TrialResult]) -> int | None:
    counts = [d.unprotected_steps for t in trials for d in t.decisions]
    return max(counts) if counts else None


def _max_unprotected_replay(trials: list[TrialResult]) -> float | None:
    """The most unprotected work any decision saw: seconds of actions a failure there
    would have replayed."""
    seconds = [d.unprotected_replay_s for t in trials for d in t.decisions]
    return _round(max(seconds)) if seconds else None


# ---------------------------------------------------------------- the accelerator estimate


def measured_trace(
    task: TraceTask, none: list[TrialResult], every: list[TrialResult]
) -> list[TraceStep] | None:
    """Per turn: generation and action durations from the `none` runs (no checkpoint beside
    the engine), checkpoint duration, its capture's share and size from the `every-step` runs."""
    if not none or not every:
        return None
    turns = len(task.turns)
    gen: dict[int, list[float]] = {}
    act: dict[int, list[float]] = {}
    ckpt: dict[int, list[float]] = {}
    capture: dict[int, list[float]] = {}
    size: dict[int, list[float]] = {}
    for t in none:
        for d in t.decisions:
            if d.actual_generation_s is not None and d.step < turns:
                gen.setdefault(d.step, []).append(d.actual_generation_s)  # turn index d.step
        for step, seconds in action_durations(t.decisions).items():
            act.setdefault(step - 1, []).append(seconds)
    for t in every:
        for d in t.decisions:
            if d.actual_checkpoint_s is not None:
                ckpt.setdefault(d.step - 1, []).append(d.actual_checkpoint_s)
                if d.actual_capture_s is not None:
                    capture.setdefault(d.step - 1, []).append(d.actual_capture_s)
                if d.actual_checkpoint_mb is not None:
                    size.setdefault(d.step - 1, []).append(d.actual_checkpoint_mb)
    all_ckpt = [s for v in ckpt.values() for s in v]
    all_capture = [s for v in capture.values() for s in v]
    means = {i: statistics.mean(v) for i, v in gen.items()}
    fixed, per_token = _affine_fit([(task.turns[i].think_tokens, s) for i, s in means.items()])
    trace = []
    for i, turn in enumerate(task.turns):
        tokens = turn.think_tokens
        # The first turn has no decision before it: the fit stands in for its measurement.
        seconds = means.get(i, fixed + per_token * tokens)
        trace.append(
            TraceStep(
                output_tokens=tokens,
                per_token_s=per_token,
                fixed_s=max(seconds - per_token * tokens, 0.0),
                action_s=statistics.mean(act.get(i, [0.0])),
                checkpoint_s=statistics.mean(ckpt.get(i) or all_ckpt or [0.0]),
                # staged checkpoints: the next action waits for the capture only
                capture_s=statistics.mean(capture.get(i) or all_capture) if all_capture else None,
                size_mb=statistics.mean(size.get(i, [0.0])),
            )
        )
    return trace


def _affine_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares seconds = fixed + per_token x tokens, both kept >= 0: the engine's
    per-token latency and its per-turn part, as the policy's predictor sees them."""
    if not points:
        return 0.0, 0.0
    mean_x = statistics.mean(x for x, _ in points)
    mean_y = statistics.mean(y for _, y in points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    if slope <= 0:
        return mean_y, 0.0
    return max(mean_y - slope * mean_x, 0.0), slope


def _none_spread_pct(none: list[TrialResult]) -> float | None:
    """How far the `none` runs differ among themselves: (max - min) / median, in percent. An
    overhead smaller than this is within the noise of the rounds run."""
    walls = [r.wall_s for r in none]
    return _round((max(walls) - min(walls)) / statistics.median(walls) * 100, 2) if len(walls) > 1 else None


def simulator_check(
    task: TraceTask, policy: PolicyConfig, clean: dict[str, list[TrialResult]]
) -> dict | None:
    """How well the simulator reproduces the runs that were measured: each mode's own
    phases (its generations as slowed by its checkpoints, its actions, its checkpoints)
    replayed through the workflow's overlap rule, against that mode's measured wall time
    and overhead. Its error here bounds how far to trust `accelerator_estimate`, which
    replays the same rule on other phases."""
    none_trace = measured_trace(task, clean["none"], clean["every-step"])
    if none_trace is None:
        return None
    measured = {m: _mean([r.wall_s for r in clean[m]]) for m in MODES}
    unmodelled = _unmodelled_s(none_trace, policy, clean["none"])
    check = {}
    for mode in CHECKPOINTING:
        own = measured_trace(task, clean[mode], clean[mode]) if clean[mode] else None
        if own is None or measured[mode] is None:
            continue
        simulated = simulate(own, mode_policy(policy, mode)).wall_s + unmodelled
        measured_pct, simulated_pct = (
            _pct(measured[mode], measured["none"]),
            _pct(simulated, measured["none"]),
        )
        check[KEY[mode]] = {
            "measured_overhead_pct": measured_pct,
            "simulated_overhead_pct": simulated_pct,
            "error_pct_points": _round(simulated_pct - measured_pct, 2),
            "wall_error_pct": _pct(simulated, measured[mode]),
        }
    return check or None


def _unmodelled_s(trace: list[TraceStep], policy: PolicyConfig, none: list[TrialResult]) -> float:
    """Work the simulator does not model (Temporal round trips, tokenizing observations): the
    measured `none` runs' mean wall time less the simulated `none` run's, at least 0."""
    simulated = simulate(trace, mode_policy(policy, "none")).wall_s
    return max(_mean([r.wall_s for r in none]) - simulated, 0.0)


def accelerator_estimate(
    task: TraceTask, policy: PolicyConfig, clean: dict[str, list[TrialResult]]
) -> dict | None:
    """The same trace with the engine on its own accelerator: generation as measured without
    a checkpoint beside it, checkpoints as measured, the workflow's overlap rule replayed by
    the simulator. Work the simulator does not model (Temporal round trips, tokenizing
    observations) is the gap between the measured and simulated `none` runs, added to all."""
    trace = measured_trace(task, clean["none"], clean["every-step"])
    if trace is None:
        return None
    timelines = {m: simulate(trace, mode_policy(policy, m)) for m in MODES}
    unmodelled = _unmodelled_s(trace, policy, clean["none"])
    walls = {m: timelines[m].wall_s + unmodelled for m in MODES}
    return {
        "none_s": _round(walls["none"]),
        "every_step_s": _round(walls["every-step"]),
        "adaptive_s": _round(walls["adaptive"]),
        "adaptive_model_s": _round(walls["adaptive-model"]),
        "every_step_overhead_pct": _pct(walls["every-step"], walls["none"]),
        "adaptive_overhead_pct": _pct(walls["adaptive"], walls["none"]),
        "adaptive_overhead_pct_model": _pct(walls["adaptive-model"], walls["none"]),
        "checkpoints": {KEY[m]: timelines[m].checkpoints for m in CHECKPOINTING},
        "max_unprotected_steps": timelines["adaptive"].max_unprotected_steps,
        "max_unprotected_steps_model": timelines["adaptive-model"].max_unprotected_steps,
        "wait_s": {KEY[m]: _round(timelines[m].wait_s) for m in CHECKPOINTING},
        "unmodelled_s": _round(unmodelled),
        # The same, if the workflow told the policy that no generation follows the last turn.
        "adaptive_overhead_pct_if_end_known": _pct(
            simulate(trace, mode_policy(policy, "adaptive"), end_tokens=0).wall_s + unmodelled, walls["none"]
        ),
        "measured_trace": [step.model_dump() for step in trace],
    }


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _pct(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return round((value - base) / base * 100, 2)


# ---------------------------------------------------------------- the trace task, the stack, the report


def load_trace_task(workload: Path, task_id: str | None) -> TraceTask:
    traces = [t for t in load_workload(workload).tasks if isinstance(t, TraceTask)]
    if task_id:
        traces = [t for t in traces if t.id == task_id]
    if not traces:
        raise click.UsageError(
            f"{workload} has no trace task{f' {task_id!r}' if task_id else ''}; "
            "the benchmark needs recorded turns (think_tokens + bash)"
        )
    return traces[0]


def stack_target(config, client) -> Target:
    chaos = Chaos(config)

    def make_input(task: TraceTask, policy: PolicyConfig, trajectory_id: str) -> TrajectoryInput:
        return trajectory_input(config, task).model_copy(
            update={"trajectory_id": trajectory_id, "policy": policy}
        )

    def kill(container: str) -> str:
        report = chaos.inject("sandbox-crash", sandbox_container=container)
        return report.detail

    return Target(
        start=lambda input: start_trajectory(client, config, input),
        make_input=make_input,
        kill_sandbox=kill,
        store=open_store(config.storage),
    )


def print_report(report: dict) -> None:
    table = Table(
        title=f"checkpoint overhead: {report['workload']}, {report['turns']} turns, "
        f"{report['rounds']} rounds (wall and overhead: min/median/max; the rest: means)"
    )
    columns = [
        "mode",
        "wall s",
        "overhead %",
        "checkpoints",
        "gen s/turn",
        "gen slowdown %",
        "ckpt s",
        "wait s",
        "max unprotected steps",
        "max unprotected s",
    ]
    failures = report.get("failures")
    if failures:
        columns += ["lost s / failure", "recovery s", "recovered from"]
    for col in columns:
        table.add_column(
            col, no_wrap=col in ("mode", "wall s", "overhead %")
        )  # min/median/max stay on one line
    for mode in MODES:
        key = KEY[mode]
        phases = report["phases"][key]
        row = [
            mode,
            _fmt_spread(report["wall_s"][key]),
            _fmt_spread(report["overhead_pct"].get(key)),
            _fmt(report["checkpoints"].get(key, 0)),
            _fmt(phases["generation_s_per_turn"]),
            _fmt(phases["generation_slowdown_pct"]),
            _fmt(phases["checkpoint_s"]),
            _fmt(phases["wait_s_per_trajectory"]),
            _fmt(phases["max_unprotected_steps"]),
            _fmt(phases["max_unprotected_replay_s"]),
        ]
        if failures:
            row += [
                _fmt(failures[key]["lost_s_per_failure"]),
                _fmt(failures[key]["recovery_s"]),
                ", ".join(failures[key]["sources"]),
            ]
        table.add_row(*row)
    out = Console(width=max(Console().width, 200))
    out.print(table)
    out.print(
        f"mean failure-free overhead of adaptive: {_fmt(report['adaptive_overhead_pct'])}% told the "
        f"trace's lengths, {_fmt(report['adaptive_overhead_pct_model'])}% predicting them (model task)"
    )
    waits = report.get("wait_overhead_pct") or {}
    out.print(
        "waiting for checkpoints on the critical path: "
        + ", ".join(f"{m} {_fmt(waits.get(KEY[m]))}%" for m in CHECKPOINTING)
        + " of the none wall time"
    )
    spread_pct = report.get("none_spread_pct")
    if spread_pct is not None and not report.get("rounds_enough"):
        out.print(
            f"the none runs differ by {spread_pct}% among themselves, more than the {GOAL_OVERHEAD_PCT}% goal: "
            "an overhead below that is noise; run more --rounds"
        )
    check = report.get("simulator_check") or {}
    if check:
        out.print(
            "the simulator on the measured runs (simulated - measured overhead, points): "
            + ", ".join(f"{m} {_fmt(v['error_pct_points'])}" for m, v in check.items())
        )
    estimate = report.get("accelerator_estimate")
    if estimate:
        out.print(
            f"engine on its own accelerator (simulated from the measured phases): every-step "
            f"{_fmt(estimate['every_step_overhead_pct'])}%, adaptive {_fmt(estimate['adaptive_overhead_pct'])}% "
            f"({estimate['checkpoints']['adaptive']} checkpoints), adaptive-model "
            f"{_fmt(estimate['adaptive_overhead_pct_model'])}% "
            f"({estimate['checkpoints']['adaptive_model']} checkpoints)"
        )


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _fmt_spread(figures: dict | None) -> str:
    return "-" if figures is None else "/".join(spread_cells(figures))
