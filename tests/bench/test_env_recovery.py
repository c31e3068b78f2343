"""`belayer bench env-recovery`'s best case: the rotated order of the methods and the figures
of a workload's repeated recoveries, on recorded outcomes. Its run on real sandboxes is in
tests/sandbox/test_env_recovery_bench.py."""

from __future__ import annotations

from types import SimpleNamespace

from belayer.bench.env_recovery import Recovery, print_report, recovery_figures, schedule


def recovery(
    seconds: float,
    *,
    consistent: bool = True,
    consistent_at: int = 9,
    same_workspace: bool = True,
    restore_s: float = 0.5,
    replayed_steps: int = 1,
    mismatch_step: int | None = None,
) -> Recovery:
    outcome = SimpleNamespace(
        consistent=consistent,
        consistent_at=consistent_at,
        restore_s=restore_s,
        replayed_steps=replayed_steps,
        mismatch_step=mismatch_step,
    )
    return Recovery(seconds, outcome, same_workspace)


def recorded() -> dict[str, list[Recovery]]:
    return {
        "belayer": [recovery(2.0, restore_s=1.5), recovery(1.0, restore_s=0.5), recovery(3.0, restore_s=2.5)],
        "replay": [
            recovery(20.0, replayed_steps=9),
            recovery(10.0, replayed_steps=9),
            recovery(12.0, replayed_steps=9),
        ],
        "fs_only": [
            recovery(4.0, consistent=False, consistent_at=7, mismatch_step=8),
            recovery(5.0, consistent=False, consistent_at=6, mismatch_step=7),
            recovery(6.0, consistent=False, consistent_at=7, mismatch_step=8),
        ],
    }


def test_each_repetition_runs_every_method_once_in_a_rotated_order():
    order = schedule(3)
    per_rep = [[method for rep, method in order if rep == n] for n in range(3)]
    assert per_rep == [
        ["belayer", "replay", "fs_only"],
        ["replay", "fs_only", "belayer"],
        ["fs_only", "belayer", "replay"],
    ]


def test_seconds_are_medians_with_their_spread_beside_them():
    figures = recovery_figures(recorded(), steps=9)
    assert figures["repetitions"] == 3
    assert (figures["belayer_s"], figures["replay_s"], figures["fs_only_s"]) == (2.0, 12.0, 5.0)
    assert figures["belayer_s_spread"] == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert figures["replay_s_spread"] == {"min": 10.0, "median": 12.0, "max": 20.0}
    assert figures["fs_only_s_spread"] == {"min": 4.0, "median": 5.0, "max": 6.0}
    assert figures["speedup_vs_replay"] == 6.0  # of the medians
    assert figures["belayer_restore_s"] == 1.5
    assert figures["belayer_restore_s_spread"] == {"min": 0.5, "median": 1.5, "max": 2.5}
    assert figures["fs_only_mismatch_step"] == 7  # the earliest over the repetitions


def test_a_verdict_holds_only_when_it_held_in_every_repetition():
    figures = recovery_figures(recorded(), steps=9)
    assert figures["state_identical"] and figures["replay_consistent"] and not figures["fs_only_consistent"]
    for spoiled in (
        recovery(1.0, same_workspace=False),
        recovery(1.0, consistent=False),
        recovery(1.0, consistent_at=8),
    ):
        runs = recorded()
        runs["belayer"][1] = spoiled
        assert not recovery_figures(runs, steps=9)["state_identical"]
    runs = recorded()
    runs["fs_only"] = [recovery(4.0)] * 3
    figures = recovery_figures(runs, steps=9)
    assert figures["fs_only_consistent"] and figures["fs_only_mismatch_step"] is None


def test_the_tables_show_min_median_and_max_of_every_method(capsys):
    row = {"name": "w", **recovery_figures(recorded(), steps=9)}
    realistic = {
        "failures": 2,
        "recovery_s": {"fs_only": {"min": 1.0, "median": 1.5, "max": 2.0}},
        "consistent_share": {"fs_only": 0.5},
        "speedup_vs_replay": {"min": 2.0, "median": 3.0, "max": 4.0},
    }
    print_report(
        {
            "repetitions": 3,
            "workloads": [row],
            "realistic": realistic,
            "machine": {"cores": 2, "load_avg": [1.0, 1.0, 1.0], "after": [2.0, 1.0, 1.0]},
        }
    )
    lines = [" ".join(line.replace("│", " ").split()) for line in capsys.readouterr().out.splitlines()]
    assert "w belayer 1.00 2.00 3.00 yes 6.0x" in lines
    assert "replay 10.00 12.00 20.00 yes" in lines and "fs-only 4.00 5.00 6.00 no" in lines
    assert "fs-only 1.00 1.50 2.00 50%" in lines
    assert "speedup vs replay per failure: 2.0x / 3.0x / 4.0x (min / median / max)" in lines
