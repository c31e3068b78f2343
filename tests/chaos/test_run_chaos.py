"""`belayer run --chaos`: how planned faults are triggered, targeted and recorded, with the
injector replaced by a recorder (the real faults run in `belayer bench chaos`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from belayer.chaos.faults import ChaosError, FaultReport
from belayer.chaos.plan import parse_plan
from belayer.cli import run as run_command
from belayer.workloads.loader import load_workload
from tests.chaos.test_schedule import EXAMPLE


class RecordingChaos:
    injected: list[str] = []
    refuse: set[str] = set()

    def __init__(self, config):
        pass

    def inject(self, kind, *, sandbox_container=None, duration_s=5.0, node=None, node_queue=None):
        if kind in self.refuse:
            raise ChaosError(f"{kind}: no target right now")
        self.injected.append(kind)
        return FaultReport(kind=kind, target=f"fake {kind}", at=0.0, detail="recorded")

    def roles(self):
        raise ChaosError("no node")


@pytest.fixture
def runner(monkeypatch, tmp_path):
    from belayer.cli.run import _inputs, _Runner
    from belayer.config import load_config

    monkeypatch.setenv("BELAYER_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(run_command, "Chaos", RecordingChaos)  # the name the runner calls
    RecordingChaos.injected, RecordingChaos.refuse = [], set()

    def make(plan: str):
        config = load_config(None)
        built = _Runner(
            config, _inputs(config, load_workload(EXAMPLE).tasks, 1, 0, False), 2, parse_plan(plan)
        )
        built.started = [i.trajectory_id for i in built.inputs]
        return built

    return make


def progress(step: int):
    return SimpleNamespace(step=step, sandbox=SimpleNamespace(container="c"), recoveries=[], node_queue="q")


async def drive(runner, steps: dict[str, list[int]], expect_faults: int = 0):
    """Step each trajectory through `steps`; once `expect_faults` faults have a record (however
    slow the machine), finish them all."""
    chaos = asyncio.ensure_future(runner._chaos())
    for tick in range(max(len(s) for s in steps.values())):
        for tid, seq in steps.items():
            if tick < len(seq):
                runner.progress[tid] = progress(seq[tick])
        await asyncio.sleep(0.15)
    while sum(f["recovered_by"] is not None or f["at"] is not None for f in runner.faults) < expect_faults:
        await asyncio.sleep(0.05)
    runner.finished.update(steps)
    await asyncio.wait_for(chaos, 30)


async def test_time_and_step_triggers_fire_in_the_order_they_come(runner):
    run = runner("engine-crash@step=3,s3-outage@t=0")
    first, second = run.started
    await drive(run, {first: [1, 2, 3, 4, 5], second: [1, 2]}, expect_faults=2)
    assert RecordingChaos.injected == ["s3-outage", "engine-crash"]
    assert run.faults[0]["at"] == 1 and run.faults[1]["at"] >= 3


async def test_a_task_id_targets_its_trajectory_and_a_refused_fault_does_not_stop_the_plan(runner):
    run = runner("sandbox-crash@step=1:edit-and-test,engine-crash@step=2:edit-and-test")
    RecordingChaos.refuse = {"sandbox-crash"}
    build, edit = run.started
    await drive(run, {build: [1], edit: [1, 2, 3]}, expect_faults=2)
    assert RecordingChaos.injected == ["engine-crash"]
    refused, injected = run.faults
    assert refused["recovered_by"].startswith("not injected: sandbox-crash") and refused["trajectory"] == edit
    assert injected["trajectory"] == edit and injected["recovery_s"] is not None


async def test_a_fault_after_the_end_is_recorded_as_not_injected(runner):
    run = runner("engine-crash@step=99")
    await drive(run, {run.started[0]: [1, 2], run.started[1]: [1]})
    assert RecordingChaos.injected == []
    assert run.faults[0]["recovered_by"] == "not injected: the target finished first"
