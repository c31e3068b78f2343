"""`belayer bench training`: its plan, schedule and accounting on recorded figures, and one
1-repetition, 1-iteration run of the real command against a private `belayer up` stack
(Temporal, SeaweedFS, podman sandboxes, a vLLM rollout node, the torch trainer).

Nothing here passes or fails on how long anything took: only on the JSON's structure and
on figures being positive and consistent with each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from belayer.bench.training import (
    FIXED_FAULTS,
    MODES,
    SHADOW,
    account,
    fault_plan,
    parse_attempt,
    schedule,
    summarize,
    union_s,
)
from tests.test_stack import belayer

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- pieces


def test_fixed_plan_puts_every_kind_once_over_the_iterations_in_a_seeded_order():
    plan = fault_plan(2, chaos_seed=0)
    assert sorted(p.fault for p in plan) == sorted(FIXED_FAULTS)
    assert [p.iteration for p in plan] == [0, 1, 0]
    assert [p.model_dump() for p in fault_plan(2, 0)] == [p.model_dump() for p in plan]
    orders = {tuple(p.fault for p in fault_plan(1, seed)) for seed in range(10)}
    assert len(orders) > 1 and all(p.iteration == 0 for p in fault_plan(1, 3))
    drawn = fault_plan(4, chaos_seed=1, chaos_rate=1.0)
    assert [p.iteration for p in drawn] == [0, 1, 2, 3]


def test_schedule_interleaves_and_restarts_the_node_once_per_repetition():
    runs = schedule(4)
    assert len(runs) == 16
    for rep in range(4):
        assert sorted(m for r, m in runs if r == rep) == sorted(MODES)
    shadows = [SHADOW[m] for _r, m in runs]
    switches = sum(1 for a, b in zip(shadows, shadows[1:], strict=False) if a != b)
    assert switches == 4  # one inside each repetition, none between (the order flips)
    assert runs[0][1] == "protected" and runs[4][1] == "unprotected"
    assert runs[8][1] == "belayer_faulted"  # clean / faulted swap every other repetition


def test_attempt_ids_and_interval_union():
    assert parse_attempt("bt1-r0-protected-i00003-learn-add-6-00-m1-a2") == {
        "iteration": 3,
        "task": "learn-add-6-00",
        "member": 1,
        "attempt": 2,
    }
    assert parse_attempt("some-other-workflow") is None
    assert union_s([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_s([(0, 10)], lo=2, hi=5) == 3
    assert union_s([]) == 0


def attempt(iteration, task, member, n, start, close, failed=False):
    return {
        "iteration": iteration,
        "task": task,
        "member": member,
        "attempt": n,
        "start": start,
        "close": close,
        "failed": failed,
    }


def test_accounting_of_thrown_away_work_and_recovery_waits():
    attempts = [
        attempt(0, "a", 0, 0, 100.0, 104.0, failed=True),  # lost at 104, retried at 105
        attempt(0, "a", 0, 1, 105.0, 112.0),  # the gating member of iteration 0
        attempt(0, "a", 1, 0, 100.0, 108.0),
        attempt(1, "a", 0, 0, 115.0, 118.0, failed=True),  # lost, but not the gating member
        attempt(1, "a", 0, 1, 118.5, 120.0),
        attempt(1, "a", 1, 0, 115.0, 122.0),
    ]
    faults = [
        {"injected_at": 103.0, "recovery_s": 1.5},  # overlaps the thrown-away interval
        {"injected_at": 116.0, "recovery_s": 2.0},
        {"injected_at": None, "recovery_s": None},
    ]  # not injected
    out = account(attempts, faults, run_start=99.0, run_end=124.0)
    assert out["trajectory_attempts"] == 6 and out["failed_attempts"] == 2
    assert out["thrown_away_trajectory_s"] == 7.0
    assert out["recovery_wait_s"] == 3.5
    assert out["wasted_s"] == 5.0 + 2.0  # [100, 105] and [116, 118]: the union, not the sum
    assert out["effective_training_time_ratio"] == round((25 - 7) / 25, 4)
    clean = account([attempt(0, "a", 0, 0, 1.0, 2.0)], [], run_start=0.0, run_end=3.0)
    assert clean["wasted_s"] == 0 and clean["effective_training_time_ratio"] == 1.0


def recorded_run(rep, mode, wall, sha="s" * 64, injected=0, wasted=0.0):
    faulted = mode.endswith("faulted")
    return {
        "repetition": rep,
        "mode": mode,
        "run_id": f"r{rep}-{mode}",
        "status": "completed",
        "reason": "",
        "wall_s": wall,
        "iterations_s": wall - 1,
        "iterations_done": 1,
        "groups_dropped": 0,
        "infra_retries": 0,
        "final_weights_sha256": sha,
        "weights_sha256": [sha],
        "rewards": [[[0.0, 1.0]]],
        "groups_with_signal": 1,
        "faults_injected": injected,
        "faults": [{"kind": "engine-crash"}] * injected if faulted else [],
        "trajectory_attempts": 2,
        "failed_attempts": 1 if mode == "baseline_faulted" else 0,
        "thrown_away_trajectory_s": 3.0 if mode == "baseline_faulted" else 0.0,
        "recovery_wait_s": 1.0 if faulted else 0.0,
        "wasted_s": wasted,
        "effective_training_time_ratio": round((wall - wasted) / wall, 4),
    }


def test_summary_of_recorded_runs():
    plan = fault_plan(1, 0)
    runs = []
    for rep in range(2):
        runs += [
            recorded_run(rep, "protected", 11.0),
            recorded_run(rep, "unprotected", 10.0),
            recorded_run(rep, "belayer_faulted", 12.0 + rep, injected=3, wasted=2.0),
            recorded_run(rep, "baseline_faulted", 24.0, injected=3, wasted=12.0),
        ]
    runs[-1]["final_weights_sha256"] = "x" * 64  # the baseline's second run lost a group
    report = summarize(runs, settings={"iterations": 1}, plan=plan)
    json.dumps(report)
    assert report["failure_free_overhead_pct"] == {"min": 10.0, "median": 10.0, "max": 10.0}
    assert report["goodput_ratio"] == {
        "min": round(24 / 13, 3),
        "median": round((2.0 + round(24 / 13, 3)) / 2, 4),
        "max": 2.0,
    }
    assert report["effective_training_time_ratio"]["baseline"]["median"] == 0.5
    assert report["effective_training_time_ratio"]["belayer"]["max"] == round(11 / 13, 4)
    correctness = report["correctness"]
    assert correctness["weights_identical_under_faults"] is True
    assert correctness["baseline_weights_identical_under_faults"] is False
    assert correctness["protections_change_no_weights"] is True and correctness["learning_signal"] is True
    assert report["faults_landed_equally"] is True and report["repetitions"] == 2
    assert set(report["modes"]) == set(MODES) and report["simulated"] == []
    assert [row["order"] for row in report["per_repetition"]][0] == list(MODES)


# ----------------------------------------------------------------------------- the real command

# Trace tasks run a few turns (they find a fault mid-way whatever the model); the learn
# task gives a warm-started model something to learn.
TRACE_TASKS = [
    {
        "id": f"trace-{name}",
        "setup": ["mkdir -p /workspace/t"],
        "check": check,
        "turns": [
            {"think_tokens": 24, "bash": f"echo {i} >> /workspace/t/log && wc -l < /workspace/t/log"}
            for i in range(4)
        ],
    }
    for name, check in (("pass", "test $(wc -l < /workspace/t/log) = 4"), ("fail", "test -f /workspace/none"))
]


def test_bench_training_on_a_private_stack(one_host_stack, tmp_path):
    """On the session's whole private stack (tests/conftest.py), which the bench leaves as it
    found it: the node restarted with its shadow; `down` and the leak check come at the
    session's end."""
    config, env = one_host_stack
    learn = yaml.safe_load((REPO / "examples/workloads/learn.yaml").read_text())["tasks"]
    workload = tmp_path / "mixed.yaml"
    workload.write_text(yaml.safe_dump({"tasks": TRACE_TASKS + learn[:1]}))
    bench = ("bench", "training", "--repetitions", "1", "--iterations", "1", "--workload", str(workload))
    done = belayer(env, *bench, "--json", timeout=1500)
    report = json.loads(done.stdout)
    roles = json.loads(
        (config.state_dir / "run" / f"rollout-{env['BELAYER_ROLLOUT__NODE_ID']}.roles.json").read_text()
    )
    assert roles["shadow"] is not None, "the node is left with its shadow"

    assert "[bench] repetition 1/1 baseline_faulted" in done.stderr
    assert report["repetitions"] == 1 and report["simulated"] == [] and report["not_simulated"]
    assert {
        "failure_free_overhead_pct",
        "goodput_ratio",
        "effective_training_time_ratio",
        "correctness",
        "clocks",
        "notes",
        "fault_plan",
        "per_repetition",
        "modes",
        "runs",
    } <= set(report)
    for figure in (
        report["failure_free_overhead_pct"],
        report["goodput_ratio"],
        report["effective_training_time_ratio"]["belayer"],
        report["effective_training_time_ratio"]["baseline"],
    ):
        assert set(figure) == {"min", "median", "max"} and figure["min"] <= figure["median"] <= figure["max"]
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == set(MODES)
    for mode, run in runs.items():
        assert run["status"] == "completed" and run["iterations_done"] == 1, run
        assert run["wall_s"] > 0 and 0 < run["iterations_s"] <= run["wall_s"]
        assert run["trajectory_attempts"] >= 2 * 2
        assert 0 <= run["wasted_s"] < run["wall_s"]
        assert 0 < run["effective_training_time_ratio"] <= 1
        # the figure is computed before wall_s and wasted_s are rounded for the JSON
        assert run["effective_training_time_ratio"] == pytest.approx(
            (run["wall_s"] - run["wasted_s"]) / run["wall_s"], abs=2e-4
        )
        if not mode.endswith("faulted"):
            assert run["failed_attempts"] == 0 and run["wasted_s"] == 0 and run["faults"] == []
    p, u = runs["protected"], runs["unprotected"]
    b, f = runs["belayer_faulted"], runs["baseline_faulted"]
    assert report["failure_free_overhead_pct"]["median"] == round(
        (p["wall_s"] - u["wall_s"]) / u["wall_s"] * 100, 2
    )
    assert report["goodput_ratio"]["median"] == round(f["wall_s"] / b["wall_s"], 3)
    assert len(b["faults"]) == len(f["faults"]) == len(report["fault_plan"]) == 3
    assert b["faults_injected"] >= 1 and f["faults_injected"] >= 1
    # Belayer recovers in place; the baseline throws away what a lost sandbox had done
    assert b["failed_attempts"] == 0 and b["groups_dropped"] == 0
    sandbox_hits = [x for x in f["faults"] if x["kind"].startswith("sandbox") and x["recovery_s"] is not None]
    if sandbox_hits:
        assert f["failed_attempts"] >= 1 and f["thrown_away_trajectory_s"] > 0
    assert report["correctness"]["weights_identical_under_faults"] is True
    assert report["correctness"]["protections_change_no_weights"] is True
