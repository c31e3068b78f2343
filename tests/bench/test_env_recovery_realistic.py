"""The realistic case of `belayer bench env-recovery`, on recorded rows: which checkpoints a
failure can use, the seeded draws, the summary. Its run on real sandboxes is in
tests/sandbox/test_env_recovery_bench.py."""

from __future__ import annotations

from types import SimpleNamespace

from belayer.bench.env_recovery_realistic import fault_at, fault_times, summarize, think_tokens, usable


def test_a_failure_uses_the_newest_checkpoints_at_or_before_it_as_the_workflow_keeps_them():
    taken = [SimpleNamespace(step=s) for s in (2, 4, 5, 7, 9)]
    assert [c.step for c in usable(taken, 8)] == [7, 5, 4]
    assert [c.step for c in usable(taken, 2)] == [2]
    assert usable(taken, 1) == []


def test_draws_are_seeded_per_workload_and_in_range():
    assert think_tokens(12, 0, "a") == think_tokens(12, 0, "a") != think_tokens(12, 0, "b")
    assert all(10 <= t <= 60 or 200 <= t <= 600 for t in think_tokens(200, 1, "a"))
    times = fault_times(30.0, 50, 2, "a")
    assert times == fault_times(30.0, 50, 2, "a") != fault_times(30.0, 50, 2, "b")
    assert all(0.0 <= t < 30.0 for t in times) and len(set(times)) == 50


# A run of three steps: a long generation before the first action, a checkpoint after it.
TIMELINE = [("generation", 1, 4.0), ("action", 1, 1.0), ("checkpoint", 1, 2.0),
            ("generation", 2, 0.5), ("action", 2, 0.5), ("generation", 3, 1.0), ("action", 3, 1.0)]  # fmt: skip


def test_a_fault_strikes_what_the_run_was_doing_at_that_moment():
    def struck(at_s):
        fault = fault_at(TIMELINE, at_s)
        return fault.during, fault.completed, fault.stored_until

    assert struck(0.0) == ("generation 1", 0, 0)  # nothing done yet: recovered from scratch
    assert struck(4.5) == ("action 1", 0, 0)  # the action in flight is not done
    assert struck(6.0) == ("checkpoint 1", 1, 0)  # done, but its checkpoint not stored yet
    assert struck(7.2) == ("generation 2", 1, 1)
    assert struck(9.9) == ("action 3", 2, 2)
    assert struck(10.0) == ("action 3", 2, 2)  # the very end
    # drawn uniformly over time, a fault lands in the long first generation most often
    hits = [fault_at(TIMELINE, t).during for t in fault_times(10.0, 1000, 0, "a")]
    assert 0.3 < hits.count("generation 1") / len(hits) < 0.5  # 4 of the run's 10 seconds


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
