"""Bad input at the command line: each a clear message naming the problem and the fix,
exit status 1, no traceback, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import free_port_block

BELAYER = [sys.executable, "-m", "belayer.cli"]


def run_cli(*args, env_extra=None, tmp_path=None):
    env = dict(os.environ, BELAYER_STATE_DIR=str(tmp_path), **(env_extra or {}))
    return subprocess.run(
        [*BELAYER, *args], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60
    )


@pytest.mark.parametrize(
    "content, expected",
    [
        (
            "tasks:\n  - id: t1\n    turns: [{think_tokens: 4, bash: ls}]\n    colour: red\n",
            "task 't1' is invalid",
        ),
        ("tasks: []\n", "has no tasks"),
    ],
)
@pytest.mark.usefixtures("local_processes")
def test_invalid_workload_starts_nothing(tmp_path, content, expected):
    workload = tmp_path / "w.yaml"
    workload.write_text(content)
    result = run_cli("run", str(workload), tmp_path=tmp_path)
    assert result.returncode == 1
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.usefixtures("local_processes")
def test_missing_workload_file(tmp_path):
    result = run_cli("run", str(tmp_path / "nope.yaml"), tmp_path=tmp_path)
    assert result.returncode == 1
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.usefixtures("local_processes")
def test_unreachable_temporal_names_the_address_and_the_fix(tmp_path):
    (port,) = free_port_block(1, with_grpc=False)
    workload = tmp_path / "w.yaml"
    workload.write_text("tasks:\n  - id: t1\n    turns: [{think_tokens: 4, bash: ls}]\n")
    result = run_cli(
        "run", str(workload), tmp_path=tmp_path, env_extra={"BELAYER_TEMPORAL__ADDRESS": f"127.0.0.1:{port}"}
    )
    assert result.returncode == 1
    assert f"cannot reach Temporal at 127.0.0.1:{port}" in result.stderr
    assert "belayer up" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.usefixtures("local_processes")
def test_chaos_plan_errors_are_clear(tmp_path):
    workload = tmp_path / "w.yaml"
    workload.write_text("tasks:\n  - id: t1\n    turns: [{think_tokens: 4, bash: ls}]\n")
    result = run_cli("run", str(workload), "--chaos", "meteor-strike@step=2", tmp_path=tmp_path)
    assert result.returncode == 1
    assert "unknown fault 'meteor-strike'" in result.stderr
