"""`belayer report`: self-contained HTML with the figures embedded, from a soak or a run JSON.
Histories are drawn from hand-made intervals here; the soak run reads real ones."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from belayer.report.build import build_report
from belayer.report.data import ReportError, load_run
from belayer.report.history import History, Interval
from belayer.report.plots import timeline

PNG = b"\x89PNG\r\n\x1a\n"


def soak_json(tmp_path: Path) -> Path:
    faults = [
        {
            "kind": kind,
            "round": 1,
            "target": "t-1",
            "trigger": "step=2",
            "at": 2,
            "injected_at": 1000.0 + i,
            "recovered_by": "takeover",
            "recovery_s": 0.5 + i,
            "injected": True,
            "detail": "",
        }
        for i, kind in enumerate(["engine-crash", "sandbox-crash", "engine-crash", "s3-outage"])
    ]
    runs = [
        {
            "id": "t-1",
            "task": "build",
            "round": 1,
            "status": "completed",
            "verdict": "ok",
            "turns": 6,
            "recoveries": [
                {"step": 3, "source": "checkpoint step 2", "replayed_steps": 1, "cut_after_step": None}
            ],
            "step_times": [[1, 1000.0], [2, 1001.0]],
        },
        {
            "id": "t-2",
            "task": "edit",
            "round": 1,
            "status": "completed",
            "verdict": "context_cut",
            "turns": 4,
            "recoveries": [{"step": 2, "source": "replay", "replayed_steps": 2, "cut_after_step": 1}],
        },
    ]
    doc = {
        "trajectories": 2,
        "faults_injected": 4,
        "lost": 0,
        "mismatched": 0,
        "failed_infra": 0,
        "context_cuts": 1,
        "leaked": {"containers": 0, "processes": 0, "shm_segments": 0, "objects": 0},
        "p50_recovery_s": 1.5,
        "p99_recovery_s": 3.5,
        "by_kind": {"engine-crash": {"injected": 2, "p50_recovery_s": 0.5, "max_recovery_s": 2.5}},
        "details": {"references": {}, "runs": runs, "faults": faults, "leaks": {}},
    }
    path = tmp_path / "soak.json"
    path.write_text(json.dumps(doc))
    return path


def test_soak_report_is_self_contained(tmp_path):
    bench = tmp_path / "env.json"
    bench.write_text(
        json.dumps(
            {"workloads": [{"name": "w", "belayer_s": 0.8, "replay_s": 9.1}], "speedup_vs_replay_min": 11.4}
        )
    )
    page = asyncio.run(build_report(soak_json(tmp_path), tmp_path / "out", [bench]))
    text = page.read_text()
    assert (tmp_path / "out" / "recovery.png").read_bytes().startswith(PNG)
    assert (tmp_path / "out" / "outcomes.png").read_bytes().startswith(PNG)
    assert len(re.findall(r"src='data:image/png;base64,", text)) == 2
    assert not re.search(r"(src|href)=['\"]https?:", text)  # nothing fetched from anywhere
    for expected in ("engine-crash", "context_cut", "speedup_vs_replay_min", "belayer_s", "env.json"):
        assert expected in text


def test_timeline_draws_intervals_faults_and_recoveries(tmp_path):
    run = load_run(soak_json(tmp_path))
    history = History(
        id="t-1",
        start=995.0,
        end=1010.0,
        intervals=[
            Interval(
                kind="generate", name="generate", scheduled=996, start=996, end=999, outcome="completed"
            ),
            Interval(
                kind="action", name="sandbox.exec", scheduled=999, start=999, end=1000, outcome="failed"
            ),
            Interval(
                kind="checkpoint",
                name="sandbox.checkpoint",
                scheduled=999,
                start=999.5,
                end=1000.5,
                outcome="completed",
            ),
            Interval(
                kind="recover",
                name="sandbox.recover",
                scheduled=1000,
                start=1002,
                end=1004,
                outcome="completed",
            ),
        ],
    )
    path = timeline(run, {"t-1": history}, tmp_path / "timeline.png")
    assert path is not None and path.read_bytes().startswith(PNG)


def test_run_json_report(tmp_path):
    doc = {
        "trajectories": [{"id": "a-1", "task": "a", "status": "completed", "turns": 3, "recoveries": []}],
        "faults": [
            {
                "kind": "engine-crash",
                "at": 2,
                "target": "leader pid 7",
                "recovered_by": "takeover",
                "recovery_s": 0.4,
            }
        ],
        "wall_s": 12.0,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    run = load_run(path)
    assert run.kind == "run" and run.faults[0].kind == "engine-crash"
    page = asyncio.run(build_report(path, tmp_path / "out", []))
    assert "engine-crash" in page.read_text()


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"something": "else"}'])
def test_wrong_input_is_a_clear_error(tmp_path, content):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(ReportError, match="belayer run --json"):
        load_run(path)
    with pytest.raises(ReportError, match="does not exist"):
        load_run(tmp_path / "missing.json")
