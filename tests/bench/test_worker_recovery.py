"""`belayer bench worker-recovery --quick` end to end on the tiny model, through the CLI: the
JSON's shape, tokens identical to an unfailed run on both sides, and the phases in order.

Nothing here passes or fails on how long anything took: the figures come from full runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.usefixtures("tiny_model")

pytest.importorskip("vllm")

PHASES = ("detection_s", "serving_s", "first_token_s", "caught_up_s")
HEADLINE = ("speedup_serving", "speedup_first_token", "speedup_caught_up", "takeover_serving_s",
            "speedup_caught_up_vs_hot_spare", "first_token_s")  # fmt: skip
SIDES = ("belayer", "baseline", "hot_spare")


def run_cli(*args: str) -> dict:
    """The bench's JSON; it exits 1 exactly when a goal of its report was missed, naming it."""
    done = subprocess.run(
        [sys.executable, "-m", "belayer.cli", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.stdout.startswith("{"), done.stderr[-4000:]
    report = json.loads(done.stdout)
    missed = [goal for goal, met in report.get("goals", {}).items() if not met]
    assert done.returncode == (1 if missed else 0), done.stderr[-4000:]
    assert all(f"goal not met: {goal}" in done.stderr for goal in missed)
    return report


@pytest.fixture(scope="module")
def result() -> dict:
    return run_cli("worker-recovery", "--quick", "--repetitions", "1")


def test_headline_fields(result):
    assert result["repetitions"] == 1
    assert result["tokens_identical"] is True
    assert all(isinstance(result[k], float) and result[k] > 0 for k in HEADLINE)
    # it leads with what a user waits for: caught up (min / median / max), then the first token
    assert list(result)[:3] == ["speedup_caught_up", "speedup_caught_up_spread", "first_token_s"]
    assert set(result["speedup_caught_up_spread"]) == {"min", "median", "max"}
    memory = result["memory_mib"]
    assert set(memory) == {"plain", "hot_spare", "belayer_private", "belayer_shared"}
    assert memory["hot_spare"] > memory["plain"] > 0  # two engines against one
    assert all(result["unfailed_tokens_per_s"][side] > 0 for side in SIDES)
    assert result["headline_weight_mode"] == "private"
    assert set(result["modes"]) == {"private", "shared"}
    assert result["simulated"] and set(result["phases"]) >= set(PHASES)


@pytest.mark.parametrize("mode", ["private", "shared"])
def test_both_sides_recover_in_order_with_identical_tokens(result, mode):
    block = result["modes"][mode]
    for side in SIDES:
        summary = block[side]
        assert summary["tokens_identical"] is True, (mode, side)
        assert len(summary["runs"]) == 1
        for phase in (*PHASES, "lost_s"):
            spread = summary[phase]
            assert spread["min"] <= spread["median"] <= spread["max"]
        for run in summary["runs"]:
            times = [run[p] for p in PHASES]
            assert times == sorted(times), (mode, side, run)
    # every Belayer recovery was a takeover by a shadow that was ready (the bench waits for it)
    assert block["belayer"]["recoveries"] == ["takeover"]
    assert all(r["waited_for_shadow_s"] == 0 for r in block["belayer"]["runs"])
    assert block["baseline"]["recoveries"] == ["restart"]
    assert block["hot_spare"]["recoveries"] == ["failover"]
    # the hot spare was loaded before the kill: no engine started after it, unlike the restart
    assert all("engine_start_s" in run for run in block["baseline"]["runs"])
    assert not any("engine_start_s" in run for run in block["hot_spare"]["runs"])


@pytest.mark.parametrize("mode", ["private", "shared"])
def test_memory_per_engine(result, mode):
    memory = result["modes"][mode]["memory_mib"]
    assert set(memory["belayer"]) >= {"owner", "leader", "shadow"}
    assert set(memory["hot_spare"]) == {"engine", "spare"}
    for mem in [*memory["belayer"].values(), memory["baseline"]["engine"], *memory["hot_spare"].values()]:
        assert mem["rss"] > 0 and mem["private"] > 0
