"""`belayer bench checkpoint`'s pure parts: the schedule, podman's stats, the summary."""

from __future__ import annotations

import json

from belayer.bench.checkpoint import MODES, Sample, schedule, summarize
from belayer.sandbox.podman import dump_phases


def test_modes_rotate_so_each_leads_in_turn():
    assert schedule(3) == [
        (0, "belayer"),
        (0, "podman"),
        (1, "podman"),
        (1, "belayer"),
        (2, "belayer"),
        (2, "podman"),
    ]


def test_dump_phases_read_podmans_print_stats_in_seconds():
    stats = {
        "podman_checkpoint_duration": 1_750_000,
        "container_statistics": [
            {
                "runtime_checkpoint_duration": 1_500_000,
                "criu_statistics": {
                    "freezing_time": 100_000,
                    "frozen_time": 1_300_000,
                    "memdump_time": 40_000,
                },
            }
        ],
    }
    phases = dump_phases(json.dumps(stats))
    assert phases == {"freeze": 0.1, "frozen": 1.3, "dump": 1.5, "archive": 0.25}
    assert dump_phases("") == {} and dump_phases('{"container_statistics": []}') == {}


def sample(mode: str, checkpoint_s: float, restore_s: float, consistent: bool = True) -> Sample:
    return Sample(
        mode,
        checkpoint_s,
        restore_s,
        archive_mb=30.0,
        checkpoint_phases={"dump": checkpoint_s / 2},
        restore_phases={"podman": restore_s / 2},
        consistent=consistent,
    )


def test_summary_spreads_ratios_and_consistency():
    samples = [
        sample("belayer", 1.0, 0.8),
        sample("podman", 3.0, 2.0),
        sample("podman", 2.0, 1.6),
        sample("belayer", 0.8, 0.6),
        sample("belayer", 1.2, 0.7, consistent=False),
        sample("podman", 4.0, 1.8),
    ]
    report = summarize(samples, repetitions=3, compression="zstd")
    ours, theirs = report["modes"]["belayer"], report["modes"]["podman"]
    assert set(report["modes"]) == set(MODES)
    assert ours["checkpoint_s"] == {"min": 0.8, "median": 1.0, "max": 1.2}
    assert theirs["restore_s"] == {"min": 1.6, "median": 1.8, "max": 2.0}
    assert report["checkpoint_speedup"] == 3.0 and report["restore_speedup"] == round(1.8 / 0.7, 2)
    assert report["belayer_checkpoint_s"] == 1.0 and report["belayer_restore_s"] == 0.7
    assert ours["checkpoint_phases_s"]["dump"] == {"min": 0.4, "median": 0.5, "max": 0.6}
    assert ours["consistent"] is False and theirs["consistent"] is True
    assert len(report["samples"]) == 6
