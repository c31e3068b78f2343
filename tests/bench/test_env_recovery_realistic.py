"""The realistic case of `belayer bench env-recovery`, on recorded rows: which checkpoints a
failure can use, the seeded draws, the summary. Its run on real sandboxes is in
tests/sandbox/test_env_recovery_bench.py."""

from __future__ import annotations

from types import SimpleNamespace

from belayer.bench.env_recovery_realistic import failure_steps, summarize, think_tokens, usable


def test_a_failure_uses_the_newest_checkpoints_at_or_before_it_as_the_workflow_keeps_them():
    taken = [SimpleNamespace(step=s) for s in (2, 4, 5, 7, 9)]
    assert [c.step for c in usable(taken, 8)] == [7, 5, 4]
    assert [c.step for c in usable(taken, 2)] == [2]
    assert usable(taken, 1) == []


def test_draws_are_seeded_per_workload_and_in_range():
    assert think_tokens(12, 0, "a") == think_tokens(12, 0, "a") != think_tokens(12, 0, "b")
    assert all(10 <= t <= 60 or 200 <= t <= 600 for t in think_tokens(200, 1, "a"))
    steps = failure_steps(9, 50, 2, "a")
    assert steps == failure_steps(9, 50, 2, "a") and set(steps) <= set(range(1, 10)) and len(set(steps)) > 3


def test_summary_of_recorded_failures():
    def row(belayer, replay, fs, fs_ok):
        return {
            "belayer_s": belayer,
            "replay_s": replay,
            "fs_only_s": fs,
            "belayer_consistent": True,
            "replay_consistent": True,
            "fs_only_consistent": fs_ok,
        }

    report = summarize([row(1.0, 10.0, 2.0, False), row(2.0, 4.0, 1.0, True), row(4.0, 4.0, 3.0, False)], [])
    assert report["recovery_s"]["belayer"] == {"min": 1.0, "median": 2.0, "max": 4.0}
    assert report["consistent_share"] == {"belayer": 1.0, "replay": 1.0, "fs_only": round(1 / 3, 3)}
    assert report["median_speedup_vs_replay"] == 2.0  # of 10, 2 and 1
    assert report["speedup_vs_replay"] == {"min": 1.0, "median": 2.0, "max": 10.0}
    assert summarize([], [])["median_speedup_vs_replay"] is None
    assert summarize([], [])["speedup_vs_replay"] is None
