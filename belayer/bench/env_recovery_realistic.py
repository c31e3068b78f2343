"""The realistic case of `belayer bench env-recovery`: failures where a user meets them.

The best-case rows place one checkpoint at a late step and fail right after the last
action. Here each workload runs once under the default adaptive policy, which decides
after every action whether to checkpoint, as the workflow does, and its timeline is kept:
each step's generation (simulated, below), action and checkpoint, as long as each took.
Failures strike at times drawn uniformly over that unfailed run (seeded), as a crash
does, not at uniformly drawn steps: a long step is hit more often than a short one. A
fault during step k's generation or action loses the sandbox with k - 1 actions done; one
during the checkpoint after step k, with k done and that checkpoint not yet stored. Each
is recovered three ways on the same host:

  belayer  -- the newest checkpoints the policy took at or before the failure (up to 3,
              as the workflow keeps them), restore + replay-verify to the failure; with
              none yet, a fresh sandbox replaying from the start;
  replay   -- a fresh sandbox with the task's setup, replaying every step;
  fs-only  -- the files of the same checkpoint, processes lost, replaying the rest.

Plus a sweep of the distance between the policy's first checkpoint and the failure.

What is simulated: the generations between actions. Their lengths are drawn (seeded): a
long reasoning turn of 200-600 tokens one time in four, else a quick tool call of 10-60
tokens, at `decode_s_per_token`. The policy sees these as measured generations and
predicts each next one from them, as it does for a model task (no trace tells it the
length); actions, checkpoints, their sizes and every recovery are real.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from belayer.measure import spread
from belayer.policy.adaptive import CheckpointPolicy, CheckpointSample, GenerationSample
from belayer.sandbox.models import Action, LoggedAction, SandboxSpec

METHODS = ("belayer", "replay", "fs_only")
MODE = {"belayer": "full", "replay": "replay", "fs_only": "fs-only"}
KEPT = 3  # checkpoints the workflow keeps (trajectory.CHECKPOINTS_KEPT)


def think_tokens(turns: int, seed: int, workload: str) -> list[int]:
    """Generated tokens before each action: long reasoning one time in four, else a quick call."""
    rng = random.Random(f"{seed}/tokens/{workload}")
    return [rng.randint(200, 600) if rng.random() < 0.25 else rng.randint(10, 60) for _ in range(turns)]


@dataclass
class PolicyRun:
    """An unfailed run under the adaptive policy: its log, the checkpoints it took, and its
    timeline (what it was doing, at which step, for how many seconds, in order)."""

    log: list  # LoggedAction, step order
    checkpoints: list  # CheckpointRef, step order
    verdicts: list[str]
    handle: object
    timeline: list[tuple[str, int, float]] = field(default_factory=list)  # ("generation" | ..., step, s)


@dataclass(frozen=True)
class Fault:
    """Where a fault drawn at `at_s` seconds into the unfailed run strikes."""

    at_s: float
    during: str  # "generation 3", "action 3", "checkpoint 3"
    completed: int  # actions done: the sandbox is recovered to after these
    stored_until: int  # the newest step whose checkpoint was stored by then


def fault_times(total_s: float, count: int, seed: int, workload: str) -> list[float]:
    """Uniformly random moments of the unfailed run (seeded per workload)."""
    rng = random.Random(f"{seed}/fault-times/{workload}")
    return [rng.uniform(0.0, total_s) for _ in range(count)]


def fault_at(timeline: list[tuple[str, int, float]], at_s: float) -> Fault:
    """The fault striking `at_s` seconds into the run of `timeline`."""
    elapsed, hit = 0.0, timeline[-1]  # the very end: as in its last part
    for part in timeline:
        if at_s < elapsed + part[2]:
            hit = part
            break
        elapsed += part[2]
    kind, step, _ = hit
    done = step if kind == "checkpoint" else step - 1
    return Fault(at_s=round(at_s, 3), during=f"{kind} {step}", completed=done, stored_until=step - 1)


def run_under_policy(host, workload, trajectory: str, policy_config, tokens: list[int],
                     decode_s_per_token: float) -> PolicyRun:  # fmt: skip

    handle = host.create(SandboxSpec(setup_commands=workload.setup, labels={"belayer.bench": "env-recovery"}))
    try:
        return _steps_under_policy(
            host,
            handle,
            workload,
            trajectory,
            CheckpointPolicy(config=policy_config),
            tokens,
            decode_s_per_token,
        )
    except BaseException:
        host.destroy(handle)
        host.delete_checkpoints(handle.sandbox_id)
        raise


def _steps_under_policy(host, handle, workload, trajectory: str, policy, tokens: list[int],
                        decode_s_per_token: float) -> PolicyRun:  # fmt: skip

    log, checkpoints, verdicts, timeline = [], [], [], []
    for step, command in enumerate(workload.actions, start=1):
        generated = tokens[step - 1]
        timeline.append(("generation", step, round(generated * decode_s_per_token, 4)))
        policy.observe_generation(
            GenerationSample(
                output_tokens=generated,
                per_token_s=decode_s_per_token,
                total_s=generated * decode_s_per_token,
            )
        )
        started = time.monotonic()
        obs = host.exec(handle, Action(trajectory=trajectory, step=step, command=command, timeout_s=600))
        timeline.append(("action", step, round(time.monotonic() - started, 4)))
        if obs.exit_code != 0:
            raise RuntimeError(
                f"workload {workload.name} step {step} failed (exit {obs.exit_code}): {obs.stderr[-1500:]}"
            )
        log.append(LoggedAction(trajectory=trajectory, step=step, command=command, timeout_s=600,
                                observation_sha256=obs.sha256))  # fmt: skip
        policy.observe_action(obs.duration_s)
        size_mb = checkpoints[-1].archive_bytes / 2**20 if checkpoints else 0.0
        decision = policy.decide(step, size_mb)  # the next generation predicted from the last ones
        verdicts.append(decision.verdict)
        if decision.checkpointed:
            started = time.monotonic()
            ref = host.checkpoint(handle, fs_snapshot=True)
            taken_s = time.monotonic() - started
            policy.observe_checkpoint(CheckpointSample(duration_s=taken_s, size_mb=ref.archive_bytes / 2**20))
            timeline.append(("checkpoint", step, round(taken_s, 4)))
            checkpoints.append(ref)
    return PolicyRun(log, checkpoints, verdicts, handle, timeline)


def usable(checkpoints: list, failed_at: int) -> list:
    """What the workflow would hold when step `failed_at` fails: newest first, at most KEPT."""
    return [c for c in reversed(checkpoints) if c.step <= failed_at][:KEPT]


def recover_three_ways(host, run: PolicyRun, spec, failed_at: int, checkpoints: list) -> dict:
    """Lose the sandbox with `failed_at` actions done; recover it by each method in turn."""
    row: dict = {"failed_at": failed_at, "checkpoint_step": checkpoints[0].step if checkpoints else None}
    for method in METHODS:
        host.kill(run.handle)
        started = time.monotonic()
        outcome = host.recover(run.handle, checkpoints, run.log[:failed_at], mode=MODE[method], spec=spec)
        row[f"{method}_s"] = round(time.monotonic() - started, 3)
        row[f"{method}_consistent"] = bool(outcome.consistent)
        row[f"{method}_source"] = outcome.source
        run.handle = outcome.handle
    return row


def summarize(failures: list[dict], sweep: list[dict]) -> dict:
    speedups = [f["replay_s"] / f["belayer_s"] for f in failures if f["belayer_s"] > 0]
    return {
        "failures": len(failures),
        "recovery_s": {m: spread([f[f"{m}_s"] for f in failures]) for m in METHODS},
        "consistent_share": {
            m: round(sum(f[f"{m}_consistent"] for f in failures) / len(failures), 3) for m in METHODS
        }
        if failures
        else {},
        "median_speedup_vs_replay": round(statistics.median(speedups), 2) if speedups else None,
        "speedup_vs_replay": spread(speedups, digits=2),
        "rows": failures,
        "distance_sweep": sweep,
    }


def run_realistic(host, workloads: list, policy_config, *, failures: int, seed: int, decode_s_per_token: float,
                  sweep_max: int, log_fn=lambda m: None) -> dict:  # fmt: skip
    """Every workload under the policy, `failures` random failures each, and the sweep."""

    rows, sweep, policies = [], [], []
    for workload in workloads:
        spec = SandboxSpec(setup_commands=workload.setup, labels={"belayer.bench": "env-recovery"})
        tokens = think_tokens(len(workload.actions), seed, workload.name)
        run = run_under_policy(
            host, workload, f"bench-real-{workload.name}", policy_config, tokens, decode_s_per_token
        )
        steps = [c.step for c in run.checkpoints]
        run_s = round(sum(seconds for _, _, seconds in run.timeline), 3)
        policies.append(
            {
                "workload": workload.name,
                "checkpoint_steps": steps,
                "verdicts": run.verdicts,
                "think_tokens": tokens,
                "run_s": run_s,
                "timeline": [list(part) for part in run.timeline],
            }
        )
        log_fn(
            f"{workload.name}: the policy checkpointed after steps {steps} of {len(run.log)} ({run_s:.1f} s)"
        )
        try:
            for at_s in fault_times(run_s, failures, seed, workload.name):
                fault = fault_at(run.timeline, at_s)
                row = recover_three_ways(host, run, spec, fault.completed,
                                         usable(run.checkpoints, fault.stored_until))  # fmt: skip
                rows.append(
                    {"workload": workload.name, "fault_at_s": fault.at_s, "during": fault.during, **row}
                )
                log_fn(
                    f"{workload.name}: fault at {fault.at_s:.1f}s ({fault.during}, {fault.completed} actions done): "
                    f"belayer {row['belayer_s']:.2f}s ({row['belayer_source']}), replay {row['replay_s']:.2f}s, "
                    f"fs-only {row['fs_only_s']:.2f}s"
                )
            if run.checkpoints:
                first = run.checkpoints[0]
                for failed_at in range(first.step, min(len(run.log), first.step + sweep_max) + 1):
                    row = recover_three_ways(host, run, spec, failed_at, [first])
                    sweep.append({"workload": workload.name, "distance": failed_at - first.step, **row})
        finally:
            host.remove(run.handle.sandbox_id)
            host.delete_checkpoints(run.handle.sandbox_id)
    return summarize(rows, sweep) | {
        # the page shows them: where the policy checkpointed, per workload
        "checkpoint_steps": {
            p["workload"]: ", ".join(map(str, p["checkpoint_steps"])) or "none" for p in policies
        },
        "policy": policies,
        "decode_s_per_token": decode_s_per_token,
        "seed": seed,
    }
