"""The documented client example works against a real stack."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "start_trajectory.py"


def load_example():
    spec = importlib.util.spec_from_file_location("start_trajectory", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_client_example_runs_a_trajectory(stack, capsys):
    example = load_example()
    result = await example.run_trajectory(stack.client, stack.queues.context, stack.queues)
    assert result.status == "completed" and result.reward == 1.0, result.reason
    assert "step" in capsys.readouterr().out
