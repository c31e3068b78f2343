"""`belayer bench env-recovery` at a tiny scale: the JSON shape and Belayer's consistency.

Speed is not asserted (no wall-clock assertions); the figures come from full-scale runs.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner


def test_env_recovery_json(sandbox_runtime, tmp_path, monkeypatch):
    from belayer.bench.env_recovery import build_wheel
    from belayer.bench.env_recovery_realistic import fault_at, fault_times
    from belayer.cli.bench.env_recovery import env_recovery

    assert build_wheel() == build_wheel()  # deterministic artefact
    monkeypatch.setenv("BELAYER_SANDBOX__MEMORY_MB", "1024")  # the default tmpfs sizes fit (config checks)
    result = CliRunner().invoke(
        env_recovery,
        [
            "--json",
            "--scale",
            "0.02",
            "--workload",
            "make-build-and-kv-server",
            "--archive-dir",
            str(tmp_path),
            "--failures",
            "2",
            "--seed",
            "3",
            "--repetitions",
            "1",
        ],
        obj={},
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    (row,) = data["workloads"]
    for key in ("name", "belayer_s", "replay_s", "fs_only_s", "speedup_vs_replay", "state_identical",
                "fs_only_consistent"):  # fmt: skip
        assert key in row
    assert row["state_identical"] is True
    assert data["repetitions"] == row["repetitions"] == 1
    for method in ("belayer", "replay", "fs_only"):
        spread = row[f"{method}_s_spread"]
        assert spread["min"] <= spread["median"] == row[f"{method}_s"] <= spread["max"]
    assert row["fs_only_consistent"] is False  # its HTTP server is gone after a files-only restore
    assert data["speedup_vs_replay_min"] == data["speedup_vs_replay_max"] == row["speedup_vs_replay"]
    assert "one checkpoint at a late step" in data["best_case"]
    # the realistic case: the adaptive policy's own checkpoints, failures at random steps
    real = data["realistic"]
    (policy,) = real["policy"]
    assert policy["checkpoint_steps"] == [s for s, v in enumerate(policy["verdicts"], 1) if v != "skip"]
    # faults strike at moments drawn over the unfailed run's own timeline
    timeline = [tuple(part) for part in policy["timeline"]]
    assert sum(seconds for *_, seconds in timeline) == pytest.approx(policy["run_s"], abs=0.01)
    faults = [fault_at(timeline, t) for t in fault_times(policy["run_s"], 2, 3, row["name"])]
    assert [(r["during"], r["failed_at"]) for r in real["rows"]] == [(f.during, f.completed) for f in faults]
    assert real["checkpoint_steps"] == {
        row["name"]: ", ".join(map(str, policy["checkpoint_steps"])) or "none"
    }
    for r, fault in zip(real["rows"], faults, strict=True):
        taken = [s for s in policy["checkpoint_steps"] if s <= fault.stored_until]
        assert r["checkpoint_step"] == (taken[-1] if taken else None)
        assert r["belayer_source"] == (f"checkpoint@{taken[-1]}" if taken else "replay-from-start")
    assert real["consistent_share"]["belayer"] == 1.0
    assert data["realistic_median_speedup_vs_replay"] == real["median_speedup_vs_replay"]
    if policy["checkpoint_steps"]:
        distances = [r["distance"] for r in real["distance_sweep"]]
        assert distances == list(range(len(distances))) and distances
    assert not any(tmp_path.rglob("archive")), "checkpoint objects left behind"
