"""`belayer bench overhead`: its schedule and summary on recorded figures, and one tiny
interleaved run with a killed sandbox per mode on the in-process stack.

Nothing here passes or fails on how long anything took: the figures come from full runs.
"""

from __future__ import annotations

import json

from belayer.bench.overhead import (
    MODES,
    Target,
    TrialResult,
    action_durations,
    mode_policy,
    print_report,
    run_bench,
    schedule,
    summarize,
)
from belayer.policy.adaptive import DecisionRecord
from belayer.policy.config import PolicyConfig
from belayer.workflows.models import RecoveryRecord, TrajectoryInput, TrajectoryResult
from belayer.workloads.models import TraceTask, TraceTurn

TOP_KEYS = {
    "none_s",
    "every_step_s",
    "adaptive_s",
    "adaptive_model_s",
    "every_step_overhead_pct",
    "adaptive_overhead_pct",
    "adaptive_overhead_pct_model",
    "checkpoints",
    "max_unprotected_steps",
    "max_unprotected_steps_model",
    "max_unprotected_replay_s",
    "max_unprotected_replay_s_model",
    "wall_s",
    "overhead_pct",
}

TASK = TraceTask(
    id="bench-tiny",
    setup=["mkdir -p /workspace/b"],
    turns=[
        TraceTurn(think_tokens=8, bash="cd /workspace/b && seq 1 500 > n.txt && wc -l < n.txt"),
        TraceTurn(think_tokens=4, bash="echo two >> n.txt && tail -1 n.txt"),
        TraceTurn(think_tokens=8, bash="wc -l < n.txt"),
        TraceTurn(think_tokens=4, bash="echo four"),
    ],
    check="test -s /workspace/b/n.txt",
)


def test_schedule_rotates_the_order_every_round():
    assert MODES == ("none", "every-step", "adaptive", "adaptive-model")
    trials = schedule(len(MODES), inject=False)
    rounds = [[t.mode for t in trials if t.round == r] for r in range(len(MODES))]
    assert rounds == [[*MODES[r:], *MODES[:r]] for r in range(len(MODES))]
    # each mode runs once in every position
    assert all(sorted(r[i] for r in rounds) == sorted(MODES) for i in range(len(MODES)))
    faulted = schedule(2, inject=True)
    assert len(faulted) == 16
    assert sorted((t.mode, t.faulted) for t in faulted if t.round == 1) == sorted(
        (m, f) for m in MODES for f in (False, True)
    )


def test_adaptive_model_is_adaptive_blind_to_the_trace_lengths():
    configured = PolicyConfig(mode="none", alpha=3.0, trace_lengths_known=False)
    assert mode_policy(configured, "adaptive-model").model_dump() == {
        **configured.model_dump(),
        "mode": "adaptive",
        "trace_lengths_known": False,
    }
    for mode in ("none", "every-step", "adaptive"):
        assert mode_policy(configured, mode).model_dump() == {
            **configured.model_dump(),
            "mode": mode,
            "trace_lengths_known": True,
        }


def decision(step, verdict, replay, gen=None, ckpt=None, wait=None, unprotected=1):
    return DecisionRecord(
        step=step,
        verdict=verdict,
        reason="",
        predicted_generation_s=1.0,
        estimated_checkpoint_s=0.5,
        unprotected_steps=unprotected,
        unprotected_replay_s=replay,
        actual_generation_s=gen,
        actual_checkpoint_s=ckpt,
        actual_checkpoint_mb=2.0 if ckpt else None,
        wait_s=wait,
    )


def test_action_durations_undo_the_unprotected_accumulation():
    decisions = [
        decision(1, "skip", 1.0),
        decision(2, "skip", 3.0, unprotected=2),
        decision(3, "forced", 3.5, unprotected=3),
        decision(4, "checkpoint", 0.25),
    ]
    assert action_durations(decisions) == {1: 1.0, 2: 2.0, 3: 0.5, 4: 0.25}


def trial(mode, round, wall, decisions, checkpoints=0, faulted=False, recoveries=()):
    return TrialResult(
        round=round,
        mode=mode,
        faulted=faulted,
        trajectory_id=f"{mode}-{round}-{faulted}",
        status="completed",
        wall_s=wall,
        checkpoints=checkpoints,
        decisions=decisions,
        recoveries=list(recoveries),
        fault_step=2 if faulted else None,
    )


def recorded_trials() -> list[TrialResult]:
    """Two rounds of figures shaped like a real run of TASK; predicting the generations
    from history, adaptive-model checkpoints once more and leaves more work unprotected."""
    out = []
    for r in range(2):
        none = [decision(s, "skip", 0.1 * s, gen=1.0, unprotected=s) for s in range(1, 4)]
        none.append(decision(4, "skip", 0.4, unprotected=4))
        every = [decision(s, "checkpoint", 0.1, gen=1.2, ckpt=0.8, wait=0.0) for s in range(1, 4)]
        every.append(decision(4, "checkpoint", 0.1, ckpt=0.8, wait=0.8))
        adaptive = [
            decision(1, "checkpoint", 0.1, gen=1.1, ckpt=0.8, wait=0.0),
            decision(2, "skip", 0.1, gen=1.0),
            decision(3, "forced", 0.2, gen=1.0, ckpt=0.8, wait=0.0, unprotected=2),
            decision(4, "skip", 0.1),
        ]
        model = [
            decision(1, "skip", 0.1, gen=1.0),
            decision(2, "checkpoint", 0.3, gen=1.1, ckpt=0.8, wait=0.2, unprotected=2),
            decision(3, "skip", 0.1, gen=1.0),
            decision(4, "forced", 0.2, ckpt=0.8, wait=0.8, unprotected=2),
        ]
        out += [
            trial("none", r, 10.0, none),
            trial("every-step", r, 11.0, every, checkpoints=4),
            trial("adaptive", r, 10.1, adaptive, checkpoints=2),
            trial("adaptive-model", r, 10.2 + r * 0.2, model, checkpoints=2),
        ]
        lost = RecoveryRecord(
            kind="sandbox",
            step=2,
            reason="killed",
            source="checkpoint@1",
            replayed_steps=1,
            consistent=True,
            time_lost_s=1.5,
        )
        out.append(trial("adaptive", r, 12.1, adaptive, checkpoints=2, faulted=True, recoveries=[lost]))
    return out


def test_summary_of_recorded_figures():
    report = summarize(TASK, PolicyConfig(mode="adaptive"), recorded_trials(), rounds=2, fail_at=2)
    assert TOP_KEYS <= set(report)
    assert report["none_s"] == 10.0 and report["every_step_s"] == 11.0
    assert report["every_step_overhead_pct"] == 10.0 and report["adaptive_overhead_pct"] == 1.0
    assert report["adaptive_model_s"] == 10.3 and report["adaptive_overhead_pct_model"] == 3.0
    assert report["checkpoints"] == {"every_step": 4, "adaptive": 2, "adaptive_model": 2}
    assert report["max_unprotected_steps"] == 2 and report["max_unprotected_steps_model"] == 2
    assert report["max_unprotected_replay_s"] == 0.2 and report["max_unprotected_replay_s_model"] == 0.3
    assert report["wall_s"]["adaptive_model"] == {"min": 10.2, "median": 10.3, "max": 10.4}
    assert report["overhead_pct"]["adaptive_model"] == {"min": 2.0, "median": 3.0, "max": 4.0}
    assert report["overhead_pct"]["adaptive"] == {"min": 1.0, "median": 1.0, "max": 1.0}
    assert report["phases"]["adaptive_model"]["wait_s_per_trajectory"] == 1.0
    every = report["phases"]["every_step"]
    assert every["generation_slowdown_pct"] == 20.0  # 1.2 s against 1.0 s for the same tokens
    assert every["checkpoint_s"] == 0.8 and every["wait_s_per_trajectory"] == 0.8
    assert report["phases"]["none"]["action_s_per_turn"] == 0.1
    assert [r["adaptive_overhead_pct"] for r in report["per_round"]] == [1.0, 1.0]
    assert [r["adaptive_model_overhead_pct"] for r in report["per_round"]] == [2.0, 4.0]
    assert report["failures"]["adaptive"]["lost_s_per_failure"] == 2.0
    assert report["failures"]["adaptive"]["sources"] == ["checkpoint@1"]
    # adaptive-model cost 3.0 %: the goal (at most 3 %) is met
    assert report["goals"] == {
        "adaptive checkpointing on model tasks costs <= 3 % failure-free (adaptive_overhead_pct_model)": True
    }
    assert report["goal_met"] is True
    # the none runs agree (10.0 s both rounds): the rounds resolve a 3 % overhead
    assert (report["none_spread_pct"], report["rounds_enough"]) == (0.0, True)
    # the simulator, given each mode's own measured phases, against that mode's runs: its
    # error is reported before its estimate is (every-step's recorded runs are 6 points
    # cheaper than their own phases replayed: the error a reader needs to see)
    check = report["simulator_check"]
    assert {m: c["measured_overhead_pct"] for m, c in check.items()} == {
        "every_step": 10.0, "adaptive": 1.0, "adaptive_model": 3.0}  # fmt: skip
    for c in check.values():
        assert c["error_pct_points"] == round(c["simulated_overhead_pct"] - c["measured_overhead_pct"], 2)
    assert check["every_step"]["error_pct_points"] == 6.0
    assert list(report).index("simulator_check") < list(report).index("accelerator_estimate")
    estimate = report["accelerator_estimate"]
    # the simulator sees no contention: every-step costs only the final checkpoint it waits for
    assert estimate["none_s"] == 10.0 and estimate["checkpoints"]["every_step"] == 4
    assert estimate["every_step_s"] >= estimate["adaptive_s"] >= estimate["none_s"]
    assert estimate["every_step_s"] >= estimate["adaptive_model_s"] >= estimate["none_s"]
    json.dumps(report)


def test_report_table_shows_every_mode_with_its_spread(capsys):
    report = summarize(TASK, PolicyConfig(mode="adaptive"), recorded_trials(), rounds=2, fail_at=2)
    print_report(report)
    table = capsys.readouterr().out
    assert "min/median/max" in table
    assert "the simulator on the measured runs" in table and "run more --rounds" not in table
    noisy = [t.model_copy(update={"wall_s": 10.5}) if (t.mode, t.round) == ("none", 1) else t
             for t in recorded_trials()]  # fmt: skip
    print_report(summarize(TASK, PolicyConfig(mode="adaptive"), noisy, rounds=2, fail_at=2))
    assert "differ by 4.88% among themselves, more than the 3.0% goal" in capsys.readouterr().out
    model_row = next(line for line in table.splitlines() if line.startswith("│ adaptive-model"))
    assert "10.20/10.30/10.40" in model_row and "2.00/3.00/4.00" in model_row
    assert "1.00% told the trace's lengths, 3.00% predicting them" in table


async def test_interleaved_run_with_one_killed_sandbox_per_mode(stack):
    def make_input(task, policy, trajectory_id):
        return TrajectoryInput(trajectory_id=trajectory_id, task=task, queues=stack.queues, policy=policy)

    async def start(input):
        return await stack.client.start_workflow(
            "TrajectoryWorkflow",
            input,
            id=input.trajectory_id,
            task_queue=stack.queues.context,
            result_type=TrajectoryResult,
        )

    def kill(container):
        stack.sandboxes.backend.podman("kill", container, check=False)
        return "podman kill"

    policy = PolicyConfig(mode="adaptive", max_unprotected_steps=2)
    report = await run_bench(
        Target(start=start, make_input=make_input, kill_sandbox=kill, store=stack.store),
        TASK,
        policy,
        rounds=1,
        inject=True,
        fail_at=2,
    )
    json.dumps(report)
    assert TOP_KEYS <= set(report) and "incomplete" not in report
    assert [row["order"] for row in report["per_round"]] == [[*MODES, *(f"{m}+fault" for m in MODES)]]
    phases = report["phases"]
    assert phases["none"]["verdicts"]["checkpoint"] + phases["none"]["verdicts"]["forced"] == 0
    assert report["checkpoints"]["every_step"] == len(TASK.turns)
    assert report["checkpoints"]["adaptive"] <= report["checkpoints"]["every_step"]
    assert report["checkpoints"]["adaptive_model"] <= report["checkpoints"]["every_step"]
    # the bound holds, told the lengths or not: never more unprotected actions than configured
    assert report["max_unprotected_steps"] <= 2 and report["max_unprotected_steps_model"] <= 2
    assert phases["none"]["max_unprotected_steps"] == len(TASK.turns)
    failures = report["failures"]
    for key in ("none", "every_step", "adaptive", "adaptive_model"):
        assert failures[key]["injected"] == 1 and failures[key]["completed"] == 1
        assert failures[key]["consistent"] is True
    assert failures["none"]["sources"] == ["replay-from-start"]
    assert all(s.startswith("checkpoint@") for s in failures["every_step"]["sources"])
    assert report["accelerator_estimate"]["checkpoints"]["every_step"] == len(TASK.turns)


def test_affine_fit_separates_the_per_turn_part_from_decoding():
    from belayer.bench.overhead import _affine_fit

    fixed, per_token = _affine_fit([(16, 1.0 + 16 * 0.05), (240, 1.0 + 240 * 0.05), (24, 1.0 + 24 * 0.05)])
    assert round(fixed, 6) == 1.0 and round(per_token, 6) == 0.05
    assert _affine_fit([(10, 2.0), (10, 4.0)]) == (3.0, 0.0)
    assert _affine_fit([]) == (0.0, 0.0)
