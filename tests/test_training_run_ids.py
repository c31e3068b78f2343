"""A run id names one run: used again with other settings, `start_training` refuses it
before anything starts, naming what differs (the trainer would otherwise adopt the first
run's checkpoints as this run's, and the iteration log conflict later). Real Temporal and
object store; no worker runs the workflows."""

from __future__ import annotations

import pytest

from belayer.storage.store import open_store
from belayer.temporal_client import connect
from belayer.training import RunIdReused, settings_key, start_training, training_input
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
