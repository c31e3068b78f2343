"""Checked-in workflow histories replay without nondeterminism errors.

A change to the workflow code that would break running trajectories fails here first.
Re-record with `BELAYER_RECORD_HISTORIES=1 pytest tests/workflows -k record_history`.
Histories named `before-<patch>--*` were recorded before that patch and are kept as they
are: they replay the branches the workflow keeps for runs started before it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from belayer.config import TemporalConfig
from belayer.temporal_client import data_converter
from belayer.workflows.trajectory import TrajectoryWorkflow

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_history_replays(path: Path):
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=[TrajectoryWorkflow], data_converter=data_converter(TemporalConfig()))
    await replayer.replay_workflow(history)


def test_histories_are_checked_in():
    assert HISTORIES, "no recorded histories under tests/workflows/histories"
