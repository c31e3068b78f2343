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
HEADLINE = ("speedup_serving", "speedup_first_token", "speedup_caught_up", "takeover_serving_s")


def run_cli(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "belayer.cli", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def result() -> dict:
    return run_cli("worker-recovery", "--quick", "--repetitions", "1")


def test_headline_fields(result):
    assert result["repetitions"] == 1
    assert result["tokens_identical"] is True
    assert all(isinstance(result[k], float) and result[k] > 0 for k in HEADLINE)
    assert result["headline_weight_mode"] == "private"
    assert set(result["modes"]) == {"private", "shared"}
    assert result["simulated"] and set(result["phases"]) >= set(PHASES)


@pytest.mark.parametrize("mode", ["private", "shared"])
def test_both_sides_recover_in_order_with_identical_tokens(result, mode):
    block = result["modes"][mode]
    for side in ("belayer", "baseline"):
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


@pytest.mark.parametrize("mode", ["private", "shared"])
def test_memory_per_engine(result, mode):
    memory = result["modes"][mode]["memory_mib"]
    assert set(memory["belayer"]) >= {"owner", "leader", "shadow"}
    for mem in [*memory["belayer"].values(), memory["baseline"]["engine"]]:
        assert mem["rss"] > 0 and mem["private"] > 0
