"""`belayer bench turn-overhead` as a user runs it, against the package's private stack:
the workflow's turn loop and the plain loop both run the trace, and the split of Belayer's
turns comes from the workflow's own history. Nothing is judged on how long it took."""

from __future__ import annotations

import json

import pytest

from tests.test_stack import belayer


def test_the_bench_measures_both_loops_and_splits_belayers_turns(stack):
    done = belayer(stack[1], "bench", "turn-overhead", "--repetitions", "1", "--json", timeout=900)
    report = json.loads(done.stdout)
    assert (report["task"], report["turns"], report["repetitions"]) == ("turn-overhead", 10, 1)
    assert "repetition 1/1 belayer" in done.stderr and "repetition 1/1 plain" in done.stderr
    belayer_turn, plain_turn = report["belayer_turn_ms"]["median"], report["plain_turn_ms"]["median"]
    assert belayer_turn > 0 and plain_turn > 0
    assert report["orchestration_ms_per_turn"] == pytest.approx(belayer_turn - plain_turn, abs=0.1)
    split = report["split_ms_per_turn"]
    parts = [split[k]["median"] for k in ("dispatch_ms", "workflow_tasks_ms", "in_activities_ms")]
    # the parts and the engine's and actions' own work tile Belayer's turn loop
    assert all(p >= 0 for p in parts)
    assert sum(parts) + report["work_turn_ms"]["belayer"]["median"] == pytest.approx(belayer_turn, rel=0.01)
    assert report["work_turn_ms"]["plain"]["median"] > 0
    # the node's slower work is named, and what a trajectory costs outside its turns is measured
    assert split["slower_work_ms"] == pytest.approx(
        report["work_turn_ms"]["belayer"]["median"] - report["work_turn_ms"]["plain"]["median"], abs=0.15
    )
    for side in ("belayer", "plain"):
        per = report["per_trajectory_s"][side]
        assert per["start_s"]["median"] > 0 and per["finish_s"]["median"] > 0, per
    assert report["machine"]["cores"] >= 1 and len(report["machine"]["load_avg"]) == 3
