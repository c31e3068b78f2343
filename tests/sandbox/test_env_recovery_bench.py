"""`belayer bench env-recovery` at a tiny scale: the JSON shape and Belayer's consistency.

Speed is not asserted (no wall-clock assertions); the figures come from full-scale runs.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.sandbox


def test_env_recovery_json(sandbox_runtime, tmp_path, monkeypatch):
    from belayer.bench.env_recovery import build_wheel, env_recovery

    assert build_wheel() == build_wheel()  # deterministic artefact
    monkeypatch.setenv("BELAYER_SANDBOX__MEMORY_MB", "768")
    result = CliRunner().invoke(
        env_recovery,
        ["--json", "--scale", "0.02", "--workload", "make-build-and-kv-server", "--archive-dir", str(tmp_path)],
        obj={},
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    (row,) = data["workloads"]
    for key in ("name", "belayer_s", "replay_s", "fs_only_s", "speedup_vs_replay", "state_identical",
                "fs_only_consistent"):  # fmt: skip
        assert key in row
    assert row["state_identical"] is True
    assert row["fs_only_consistent"] is False  # its HTTP server is gone after a files-only restore
    assert data["speedup_vs_replay_min"] == data["speedup_vs_replay_max"] == row["speedup_vs_replay"]
    assert not any(tmp_path.rglob("archive")), "checkpoint objects left behind"
