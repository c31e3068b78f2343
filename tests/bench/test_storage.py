"""`belayer bench storage`: the rotated schedule and the summary of its repetitions; its run
on SeaweedFS is in tests/storage/test_bench_storage.py."""

from __future__ import annotations

from belayer.bench.storage import MODES, result_table, schedule, summarize
from belayer.storage.config import StorageConfig


def test_each_repetition_runs_every_path_once_in_a_rotated_order():
    order = schedule(3)
    per_rep = [[mode for rep, mode in order if rep == n] for n in range(3)]
    assert per_rep == [
        ["local_copy", "upload", "download"],
        ["upload", "download", "local_copy"],
        ["download", "local_copy", "upload"],
    ]
    assert order.index((0, "upload")) < order.index((0, "download"))  # the object exists before any download


def test_summary_keeps_each_single_figure_as_the_median_with_its_spread_beside_it():
    seconds = {"local_copy": [0.1, 0.4, 0.2], "upload": [2.0, 1.0, 4.0], "download": [1.0, 0.5, 0.8]}
    report = summarize(seconds, size_mb=8, cfg=StorageConfig())
    assert report["repetitions"] == 3
    assert report["upload_mb_s_spread"] == {"min": 2.0, "median": 4.0, "max": 8.0}
    assert report["local_copy_mb_s_spread"] == {"min": 20.0, "median": 40.0, "max": 80.0}
    assert report["download_mb_s_spread"] == {"min": 8.0, "median": 10.0, "max": 16.0}
    assert [report[f"{mode}_mb_s"] for mode in MODES] == [40.0, 4.0, 10.0]
    assert report["upload_vs_local"] == 0.1 and report["download_vs_local"] == 0.25  # of the medians


def test_the_table_shows_min_median_and_max_of_every_path():
    seconds = {"local_copy": [0.1, 0.4, 0.2], "upload": [2.0, 1.0, 4.0], "download": [1.0, 0.5, 0.8]}
    table = result_table(summarize(seconds, size_mb=8, cfg=StorageConfig()))
    assert [c.header for c in table.columns] == ["path", "min", "median", "max", "median vs local copy"]
    assert list(table.columns[1].cells) == ["20.0", "2.0", "8.0"]
    assert list(table.columns[3].cells) == ["80.0", "8.0", "16.0"]
    assert "min / median / max of 3" in str(table.title)
