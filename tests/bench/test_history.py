"""`belayer bench long-trajectory`: the report over repeated trajectories, from recorded
figures; its run on the stack is `belayer bench long-trajectory --turns 30`."""

from __future__ import annotations

from belayer.bench.history import print_report, summarize


def trajectory(
    n: int,
    wall_s: float,
    *,
    status: str = "completed",
    reason: str = "",
    history: int = 1000,
    payload: int = 100,
    runs: int = 3,
) -> dict:
    return {
        "trajectory_id": f"long-30-1-{n}",
        "status": status,
        "reason": reason,
        "tokens": 60,
        "wall_s": wall_s,
        "runs": runs,
        "largest_history_bytes": history,
        "largest_payload_bytes": payload,
        "first_input_bytes": 500,
        "last_input_bytes": 700 + n,
    }


def test_times_are_spread_and_sizes_are_their_largest():
    report = summarize(
        [trajectory(1, 30.0, history=1200), trajectory(2, 60.0, payload=400, runs=4), trajectory(3, 45.0)],
        turns=30,
        every=10,
    )
    assert report["repetitions"] == 3 and report["status"] == "completed" and report["reason"] == ""
    assert report["wall_s"] == 45.0 and report["wall_s_spread"] == {"min": 30.0, "median": 45.0, "max": 60.0}
    assert report["s_per_turn_spread"] == {"min": 1.0, "median": 1.5, "max": 2.0}
    assert (report["largest_history_bytes"], report["largest_payload_bytes"], report["runs"]) == (
        1200,
        400,
        4,
    )
    assert report["last_input_bytes"] == 703
    assert [t["trajectory_id"] for t in report["trajectories"]] == [
        "long-30-1-1",
        "long-30-1-2",
        "long-30-1-3",
    ]


def test_a_repetition_that_ended_otherwise_shows_in_the_status():
    report = summarize(
        [
            trajectory(1, 30.0),
            trajectory(2, 31.0, status="failed_infra", reason="sandbox lost"),
            trajectory(3, 32.0, status="failed_infra", reason="sandbox lost"),
        ],
        turns=30,
        every=10,
    )
    assert report["status"] == "mixed" and report["reason"] == "sandbox lost"
    assert summarize([trajectory(1, 30.0)], turns=30, every=10)["status"] == "completed"


def test_the_table_gives_min_median_max_and_each_trajectory(capsys):
    print_report(summarize([trajectory(1, 30.0), trajectory(2, 60.0)], turns=30, every=10))
    out = capsys.readouterr().out
    assert "30.0 / 45.0 / 60.0 (min / median / max)" in out and "1.0 / 1.5 / 2.0 (min / median / max)" in out
    assert "long-30-1-2: completed in 60.0 s, 3 runs" in out
