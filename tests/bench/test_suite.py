"""`belayer bench all`: every benchmark is in the suite, the figures of their JSON reach the
page, and one real benchmark process (`storage`, small) runs, fails, and is written up."""

from __future__ import annotations

import json

import pytest

from belayer.bench.suite import BENCHES, Bench, Outcome, figures, markdown, plots_page, run_one, write_outputs
from belayer.cli.bench import bench
from belayer.measure import machine_description

MACHINE = {"cores": 2, "before": [0.5, 0.4, 0.3], "after": [1.5, 1.0, 0.5]}


def test_every_benchmark_command_is_in_the_suite():
    assert {b.name for b in BENCHES} == set(bench.commands) - {"all"}


def test_every_repetitions_option_the_suite_passes_is_one_its_benchmark_takes():
    for b in BENCHES:
        if b.repetitions_option:
            assert b.repetitions_option in {opt for p in bench.commands[b.name].params for opt in p.opts}, (
                b.name
            )
    assert [b.name for b in BENCHES if not b.repetitions_option] == ["chaos"]  # its rounds, at its default


def test_figures_are_found_at_any_depth_and_lists_of_runs_left_out():
    deep = {"min": 0.1, "median": 0.2, "max": 0.3}
    report = {
        "speedup": 2.8,
        "fork": {"ready_s": {"min": 1.0, "median": 2.0, "max": 3.0}, "group": 8},
        "runs": [{"ready_s": 1.0}],
        "identical_start": True,
        "goal": "cpu_ms_per_turn <= 10",
        "log": "x" * 500,
        "per": {"64": {"belayer": {"by_process": {"temporal": deep}}}},
        "machine": {"cores": 2},
    }
    spreads, numbers = figures(report)
    assert spreads == [
        ("fork.ready_s", {"min": 1.0, "median": 2.0, "max": 3.0}),
        ("per.64.belayer.by_process.temporal", deep),
    ]
    assert numbers == [("speedup", 2.8), ("fork.group", 8), ("identical_start", True),
                       ("goal", "cpu_ms_per_turn <= 10")]  # fmt: skip
    assert "| identical_start | yes |" in markdown(
        [Outcome("fork", ["belayer"], True, 1.0, report=report)],
        {"cores": 2, "before": [0] * 3, "after": [0] * 3},
    )


def test_named_rows_are_read_by_name():
    belayer_s = {"min": 1.0, "median": 2.0, "max": 3.0}
    report = {
        "workloads": [{"name": "git", "belayer_s": 2.0, "belayer_s_spread": belayer_s, "action_s": [0.1]}],
        "trajectories": [{"trajectory_id": "t-1", "wall_s": 9.0}],
    }
    spreads, numbers = figures(report)
    assert spreads == [("workloads.git.belayer_s_spread", belayer_s)]
    assert numbers == [("workloads.git.belayer_s", 2.0)]


def test_the_page_has_every_benchmark_its_figures_and_its_failure(tmp_path):
    good = Outcome(
        "fork",
        ["belayer", "bench", "fork", "--json"],
        True,
        12.0,
        report={"speedup": 2.8, "fork_ready_s": {"min": 1.0, "median": 2.0, "max": 3.5}},
    )
    bad = Outcome("publish", ["belayer", "bench", "publish", "--json"], False, 3.0, error="exit 1:\nno node")
    single = Outcome("chaos", ["belayer", "bench", "chaos", "--json"], True, 60.0, report={"lost": 0})
    page = markdown([good, bad, single], MACHINE)
    assert "## fork" in page and "| fork_ready_s | 2 | 1 | 3.5 |" in page and "| speedup | 2.8 |" in page
    assert "## publish" in page and "no node" in page
    assert "2 cores" in page and "0.50 / 0.40 / 0.30 before" in page
    described = markdown(
        [good],
        MACHINE
        | {
            "description": {
                "cpu": "Xeon X",
                "cores": 2,
                "memory_gib": 23.4,
                "kernel": "6.18",
                "os": "Debian 12",
                "commit": "abc",
            }
        },
    )
    assert "Machine: Xeon X, 2 cores, 23.4 GiB, Linux 6.18, Debian 12; Belayer abc." in described
    plots = plots_page([good, bad, single], MACHINE, tmp_path)
    assert plots.count("data:image/png;base64,") == 1 and "failed; see its log" in plots
    assert "no repeated figures" in plots
    assert (tmp_path / "fork.png").is_file() and not (tmp_path / "publish.png").exists()


def test_a_benchmark_process_runs_and_a_failing_one_is_recorded(storage_config, tmp_path, monkeypatch):
    cfg = storage_config
    for name, value in {
        "BELAYER_CONFIG": "",
        "BELAYER_STORAGE__ENDPOINT": cfg.endpoint,
        "BELAYER_STORAGE__BUCKET": cfg.bucket,
        "BELAYER_STORAGE__ACCESS_KEY": cfg.access_key.get_secret_value(),
        "BELAYER_STORAGE__SECRET_KEY": cfg.secret_key.get_secret_value(),
        "BELAYER_STORAGE__KEY_PREFIX": cfg.key_prefix,
    }.items():
        monkeypatch.setenv(name, value)
    ran = run_one(
        Bench("storage", ("--size-mb", "4", "--dir", str(tmp_path)), repetitions_option=None), tmp_path, 3
    )
    broken = run_one(Bench("storage", ("--size-mb", "0"), repetitions_option=None), tmp_path, 3)
    assert ran.ok and ran.command == [
        "belayer",
        "bench",
        "storage",
        "--size-mb",
        "4",
        "--dir",
        str(tmp_path),
        "--json",
    ]
    assert json.loads((tmp_path / "storage.json").read_text())["upload_mb_s"] > 0
    assert not broken.ok and "exit 2" in broken.error and "--size-mb" in broken.error
    write_outputs(tmp_path, [ran, broken], MACHINE)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(b["name"], b["ok"]) for b in summary["benchmarks"]] == [("storage", True), ("storage", False)]
    page = (tmp_path / "benchmarks.md").read_text()
    assert (
        "| upload_mb_s |" in page and "| upload_mb_s_spread |" in page
    )  # the median, and min / median / max
    assert (tmp_path / "plots.html").read_text().count("data:image/png;base64,") == 1


@pytest.mark.usefixtures("local_processes")
def test_the_machine_is_described_from_this_machine():
    described = machine_description()
    assert described["cores"] >= 1 and described["memory_gib"] > 0 and described["kernel"]
    assert described["cpu"] != "unknown" and described["os"]
    assert described["commit"].split("+")[0].isalnum()


def test_a_failed_verdict_keeps_its_figures(tmp_path, monkeypatch):
    """A benchmark that prints its report and exits 1 (its own verdict failed, as a chaos
    soak that lost a trajectory does) is a failure whose figures still reach the page."""
    import subprocess

    printed = json.dumps({"lost": 1, "recovery_s_spread": {"min": 1.0, "median": 2.0, "max": 4.0}})
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, printed, ""))
    outcome = run_one(Bench("chaos", repetitions_option=None), tmp_path, 3)
    assert not outcome.ok and "its own verdict failed" in outcome.error
    assert json.loads((tmp_path / "chaos.json").read_text())["lost"] == 1
    page = markdown([outcome], MACHINE)
    assert "Failed:" in page and "| recovery_s_spread | 2 | 1 | 4 |" in page and "| lost | 1 |" in page
    assert "failed; see its log" in plots_page([outcome], MACHINE, tmp_path)
