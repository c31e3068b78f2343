"""`belayer bench turn-throughput`: the CPU ledger on real processes, the grouping of a
process table, the marginal per-turn arithmetic and the options; its run on the real
stack is in tests/training/test_turn_throughput_stack.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from belayer.bench.cpu_ledger import CpuLedger
from belayer.bench.turn_throughput import group_processes, summarize
from belayer.cli.bench.output import exit_status
from belayer.cli.main import main as cli

BURN_S = 0.4
# A child that burns BURN_S of CPU (not of wall time) and ends.
BURN = f"import time\nwhile time.process_time() < {BURN_S}: pass\n"


def test_a_child_that_ends_inside_the_window_is_charged_once(local_processes):
    """Its CPU is seen while it runs and again in its parent's children time once reaped:
    the ledger counts it once, between the child and its parent."""
    with CpuLedger(interval_s=0.05) as ledger:
        child = subprocess.run([sys.executable, "-c", BURN], check=True)
    assert child.returncode == 0
    me = os.getpid()
    mine = ledger.processes[me]["cpu_s"] + sum(
        row["cpu_s"] for row in ledger.processes.values() if row["parent"] == me
    )
    # the child's burn, plus its interpreter's start and this process's own waiting, once
    # (CPU times come in ticks of 10 ms: a tick's worth of slack below)
    assert BURN_S - 0.02 <= mine < 2 * BURN_S, {pid: r for pid, r in ledger.processes.items() if r["cpu_s"]}
    assert ledger.wall_s > 0


def test_a_process_alive_across_the_window_is_charged_only_inside_it(local_processes):
    burner = subprocess.Popen(
        [sys.executable, "-c", BURN + "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        while _cpu_s(burner.pid) < BURN_S - 0.02:  # the burn happens before the window
            time.sleep(0.02)
        with CpuLedger(interval_s=0.05) as ledger:
            pass
        assert ledger.processes[burner.pid]["cpu_s"] < BURN_S / 2, ledger.processes[burner.pid]
    finally:
        burner.communicate(b"")


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def row(name: str, parent: int, cpu_s: float) -> dict:
    return {"name": name, "command": name, "parent": parent, "cpu_s": cpu_s}


def test_processes_are_grouped_by_what_they_serve():
    processes = {
        1: row("init", 0, 0.5),
        2: row("kthreadd", 0, 0.1),
        30: row("kworker/0:1", 2, 0.2),
        100: row("temporal", 1, 1.0),
        200: row("python3", 1, 2.0),  # the sandbox worker
        201: row("podman", 200, 0.3),  # podman it runs: podman's, not the worker's
        202: row("runc", 201, 0.1),
        300: row("conmon", 1, 0.05),  # a sandbox's monitor, adopted by init
        301: row("python3", 300, 0.4),  # the sandbox's first process (the supervisor)
        302: row("bash", 301, 0.2),  # an action
        400: row("python", 1, 0.7),  # the bench itself
        401: row("python", 400, 0.1),  # the CPU sampler's parent side, a thread pool...
        500: row("sshd", 1, 0.3),
    }
    groups = group_processes(processes, services={100: "temporal", 200: "sandbox-worker"}, me=400)
    assert groups == {
        "other": 0.8,  # init, sshd
        "kernel": 0.3,
        "temporal": 1.0,
        "sandbox-worker": 2.0,
        "podman": 0.4,
        "conmon": 0.05,
        "in-sandbox": 0.6,
        "bench": 0.8,
    }


def window(rep: int, mode: str, count: int, turns: int, wall_s: float, **cpu_s: float) -> dict:
    return {"repetition": rep, "mode": mode, "concurrency": count, "turns": turns, "wall_s": wall_s,
            "cpu_s": cpu_s, "statuses": {"completed": count}}  # fmt: skip


def test_per_turn_is_the_long_run_less_the_short_one_over_the_turns_it_added():
    # 4 trajectories: 2 turns then 6, so 16 turns added. Belayer: 100 ms a turn in Temporal
    # and 50 in the sandbox, 1 s per trajectory of setup; the plain loop: the sandbox only.
    def belayer(turns):
        return dict(temporal=0.1 * 4 * turns, **{"in-sandbox": 0.05 * 4 * turns + 4.0}, kernel=9.0)

    def plain(turns):
        return {"in-sandbox": 0.05 * 4 * turns + 2.0, "temporal": 0.01 * turns}

    windows = [
        window(0, "belayer", 4, 2, 2.0, **belayer(2)),
        window(0, "belayer", 4, 6, 4.0, **belayer(6)),
        window(0, "plain", 4, 2, 1.0, **plain(2)),
        window(0, "plain", 4, 6, 1.5, **plain(6)),
    ]
    report = summarize(windows, concurrency=(4,), turns=(2, 6), repetitions=1)
    run = report["runs"]["4"]
    assert run["belayer"]["cpu_ms_per_turn"]["median"] == pytest.approx(150.0)
    assert run["belayer"]["turns_per_s"]["median"] == pytest.approx(8.0)  # 16 turns in 2 more seconds
    assert run["belayer"]["per_trajectory_cpu_ms"]["median"] == pytest.approx(1000.0)
    assert run["belayer"]["not_in_total_ms_per_turn"]["kernel"]["median"] == 0.0
    assert run["plain"]["cpu_ms_per_turn"]["median"] == pytest.approx(50.0)  # Temporal is no part of it
    assert run["plain"]["per_trajectory_cpu_ms"]["median"] == pytest.approx(500.0)
    assert run["cpu_ratio_vs_plain"] == 3.0 and run["turns_per_s_ratio_vs_plain"] == 0.25
    assert (report["concurrency"], report["cpu_ms_per_turn"], report["goal_met"]) == (4, 150.0, False)
    assert report["goals"] == {"cpu_ms_per_turn <= 10 at 4 concurrent trajectories": False,
                               "every trajectory completed": True}  # fmt: skip
    assert report["control_plane_turns_per_s_per_core"] == pytest.approx(6.7)


def test_a_missed_goal_is_named_and_exits_1(capsys):
    assert exit_status({"goals": {"fast": True, "small": False, "cheap": False}}) == 1
    assert capsys.readouterr().err == "goal not met: small\ngoal not met: cheap\n"
    assert exit_status({"goals": {"fast": True}}) == 0 and exit_status({"speedup": 2.0}) == 0


def test_the_options_are_checked_before_anything_runs():
    runner = CliRunner()
    for args, message in (
        (["--turns", "8,2"], "SHORT < LONG"),
        (["--turns", "4"], "SHORT,LONG"),
        (["--concurrency", "0,16"], "at least 1"),
        (["--concurrency", "a"], "comma-separated"),
    ):
        result = runner.invoke(cli, ["bench", "turn-throughput", *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_runs_too_short_to_tell_apart_give_no_rate_rather_than_an_error():
    windows = [
        window(0, mode, 3, turns, 0.7, **{"in-sandbox": 0.1 * turns, "temporal": 0.2 * turns})
        for mode in ("belayer", "plain")
        for turns in (1, 3)
    ]
    report = summarize(windows, concurrency=(3,), turns=(1, 3), repetitions=1)
    assert report["turns_per_s"] is None and report["runs"]["3"]["turns_per_s_ratio_vs_plain"] is None
    assert report["cpu_ms_per_turn"] == pytest.approx(100.0)
