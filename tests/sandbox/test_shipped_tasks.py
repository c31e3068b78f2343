"""The Harbor tasks shipped in examples/tasks/ pass `belayer tasks check` on the real stack:
every image builds offline (a mapped FROM, a prebuilt docker_image, a package installed
from the registry), every oracle scores 1 and every nop 0, the multi-step task included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples" / "tasks"


def storage_env(storage_config) -> dict[str, str]:
    """The CLI pointed at the session's object store (its key prefix included)."""
    return dict(
        os.environ,
        BELAYER_STORAGE__ENDPOINT=storage_config.endpoint,
        BELAYER_STORAGE__BUCKET=storage_config.bucket,
        BELAYER_STORAGE__ACCESS_KEY=storage_config.access_key.get_secret_value(),
        BELAYER_STORAGE__SECRET_KEY=storage_config.secret_key.get_secret_value(),
        BELAYER_STORAGE__KEY_PREFIX=storage_config.key_prefix,
    )


def test_every_shipped_task_scores_1_with_its_oracle_and_0_with_nop(sandbox_runtime, storage_config):
    checked = subprocess.run(
        [sys.executable, "-m", "belayer.cli", "tasks", "check", str(EXAMPLES), "--json"],
        env=storage_env(storage_config), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    tasks = json.loads(checked.stdout)["tasks"]
    assert len(tasks) >= 8
    assert {(t["task"], t["oracle"], t["nop"]) for t in tasks} == {(t["task"], 1.0, 0.0) for t in tasks}
    assert any(t["steps"] > 1 for t in tasks)  # the multi-step task ran its steps in order
    assert all(t["metadata"].get("difficulty") for t in tasks)  # [metadata] kept and shown
