"""`belayer bench publish --quick` end to end on the tiny model, through the CLI: the JSON's
shape, no in-flight token lost, versions consistent, the new weights really served (the
probe's tokens equal a fresh engine's on the new file and differ from the old weights'),
and the publish phases in order.

Nothing here passes or fails on how long anything took: the figures come from full runs.
"""

from __future__ import annotations

import pytest

from tests.bench.test_worker_recovery import run_cli

pytestmark = pytest.mark.usefixtures("tiny_model")

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def result() -> dict:
    return run_cli("publish", "--quick", "--repetitions", "1")


def test_its_goals_are_judged(result):
    assert len(result["goals"]) == 3 and result["goal_met"] == all(result["goals"].values())
    reload_goal = "a publish is no slower than vLLM's own reload_weights (speedup_vs_reload >= 1)"
    assert result["goals"][reload_goal] == (result["speedup_vs_reload"] >= 1)


def test_headline_fields(result):
    headline = (
        "publish_s",
        "publish_inflight_s",
        "restart_s",
        "reload_s",
        "speedup_vs_restart",
        "speedup_vs_reload",
    )
    for key in headline:
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["repetitions"] == 1
    assert result["simulated"]


def test_in_flight_requests_lose_nothing_and_versions_are_consistent(result):
    assert result["inflight_tokens_lost"] == 0
    assert result["version_problems"] == []
    assert result["versions_consistent"] is True
    for run in result["runs"]:
        assert (
            run["belayer_idle"]["engines_on_new_version"]
            and run["belayer_inflight"]["engines_on_new_version"]
        )


def test_every_path_serves_the_new_weights(result):
    assert result["probe_tokens_match_fresh_engine"] is True
    assert result["new_version_changes_tokens"] is True


def test_publish_phases_in_order(result):
    phases = ("staged_s", "written_s", "sealed_s", "switched_s", "returned_s", "publish_s")
    for run in result["runs"]:
        for side in ("belayer_idle", "belayer_inflight"):
            times = [run[side][k] for k in phases]
            assert times == sorted(times), run[side]
        assert run["restart"]["write_s"] <= run["restart"]["restart_s"]
        assert run["reload"]["write_s"] <= run["reload"]["reload_s"]
