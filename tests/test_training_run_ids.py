"""A run id names one run: used again with other settings, `start_training` refuses it
before anything starts, naming what differs (the trainer would otherwise adopt the first
run's checkpoints as this run's, and the iteration log conflict later). Real Temporal and
object store; no worker runs the workflows."""

from __future__ import annotations

import json

import pytest

from belayer.storage.store import open_store
from belayer.temporal_client import connect
from belayer.training import (
    RunIdReused,
    claim_run_id,
    settings_key,
    start_training,
    tasks_by_reference,
    training_input,
)
from belayer.workloads.models import TraceTask, TraceTurn

TASKS = [TraceTask(id="t0", turns=[TraceTurn(think_tokens=1, bash="true")])]


@pytest.fixture
def config(temporal_server, stack_config, storage_config):
    return stack_config.model_copy(update={"storage": storage_config})


def run(config, run_id: str, **overrides):
    settings = {"iterations": 2, "group_size": 2, "tasks_per_iteration": 1, "seed": 0} | overrides
    return training_input(config, TASKS, run_id=run_id, **settings)


async def test_a_run_id_used_with_other_settings_is_refused_before_it_starts(config):
    """Temporal would start it: the first run has ended, and a closed workflow's id may be reused."""
    client = await connect(config.temporal)
    first = await start_training(client, config, run(config, "reused-run"))
    await first.terminate("ended")
    with pytest.raises(
        RunIdReused,
        match=r"run id 'reused-run' was used by a run with other settings \(iterations, seed, trainer differ\)",
    ):
        await start_training(client, config, run(config, "reused-run", seed=1, iterations=3))
    latest = await client.get_workflow_handle("reused-run").describe()
    assert latest.run_id == first.result_run_id, "the refused start started nothing"
    with open_store(config.storage, encrypted=False) as store:
        assert store.exists(settings_key("reused-run"))


async def test_the_same_settings_again_are_the_same_run(config):
    client = await connect(config.temporal)
    first = await start_training(client, config, run(config, "same-run"))
    await first.terminate("stopped, to start again")
    again = await start_training(client, config, run(config, "same-run"))
    assert again.id == first.id
    await again.terminate("test over")


def test_a_run_is_the_same_run_whichever_way_it_carries_its_tasks(config):
    """Inline tasks claim as the set they are stored as: a run claimed before task sets
    (its settings record the tasks inline) is the same run when resumed by reference,
    and other tasks are still other settings."""
    inline = run(config, "carried-alike")
    before = inline.model_dump(mode="json", exclude={"run_id", "queues", "carried"})  # as claimed until now
    with open_store(config.storage, encrypted=False) as store:
        store.put_bytes(
            settings_key("carried-alike"),
            json.dumps({"settings_sha256": "0" * 64, "settings": before}).encode(),
        )
        claim_run_id(store, tasks_by_reference(store, inline))
        claim_run_id(store, inline)
        other = training_input(config, [*TASKS, TraceTask(id="t1", turns=TASKS[0].turns)], run_id="carried-alike",
                               iterations=2, group_size=2, tasks_per_iteration=1, seed=0)  # fmt: skip
        with pytest.raises(RunIdReused, match=r"\(task_set differ\)"):
            claim_run_id(store, tasks_by_reference(store, other))
