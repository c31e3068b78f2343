"""A run's tasks and a step's samples by reference: stored once, read back only as stored
(a damaged object is refused, never half-read), drawn alike from a stored set and inline."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from belayer.config import load_config
from belayer.contracts.batches import parts
from belayer.storage.errors import CorruptObject
from belayer.storage.store import open_store
from belayer.storage.tokenlog import PrefixRef
from belayer.trainer.batch import batch_prefix, load_samples, store_samples
from belayer.trainer.models import TrainSample
from belayer.training import TooManySetups, tasks_by_reference, training_input
from belayer.workflows.training_models import MAX_REUSED_SETUPS
from belayer.workloads.models import TraceTask, TraceTurn
from belayer.workloads.task_set import load_task_set, pick, store_task_set


def tasks(n: int) -> list[TraceTask]:
    return [TraceTask(id=f"t{i}", turns=[TraceTurn(think_tokens=1, bash=f"echo {i}")]) for i in range(n)]


def samples(n: int) -> list[TrainSample]:
    context = PrefixRef(key="t/x", length=3, sha256="0" * 64)
    return [
        TrainSample(trajectory_id=f"m{i}", group=f"g{i // 4}", context=context, advantage=i / n)
        for i in range(n)
    ]


@pytest.fixture
def store(seaweedfs, storage_config):
    with open_store(storage_config, encrypted=False) as store:
        yield store


def test_a_task_set_is_stored_under_its_own_hash_and_read_back_whole(store):
    ref = store_task_set(store, tasks(300))
    assert ref == store_task_set(store, tasks(300)), "the same tasks are the same object"
    assert ref.count == 300 and ref.key == f"task-sets/{ref.sha256}.json"
    assert load_task_set(store, ref) == tasks(300)
    assert store_task_set(store, tasks(299)).sha256 != ref.sha256


def test_a_damaged_task_set_is_refused(store):
    ref = store_task_set(store, tasks(5))
    store.put_bytes(ref.key, store.get_bytes(ref.key).replace(b"echo 3", b"echo 9"))
    with pytest.raises(CorruptObject):
        load_task_set(store, ref)


def test_a_draw_depends_on_seed_and_iteration_only():
    drawn = pick(tasks(50), seed=4, iteration=2, count=5)
    assert drawn == pick(list(reversed(tasks(50))), seed=4, iteration=2, count=5), "not on the set's order"
    assert len({t.id for t in drawn}) == 5
    assert drawn != pick(tasks(50), seed=4, iteration=3, count=5)


def test_samples_are_stored_in_parts_and_read_back_in_order(store):
    batch = samples(1100)
    cut = parts(batch)
    assert [len(p) for p in cut] == [512, 512, 76]
    refs = [store_samples(store, "run-x", 3, part) for part in cut]
    assert all(r.key.startswith(batch_prefix("run-x", 3)) for r in refs)
    assert load_samples(store, refs) == batch
    assert store_samples(store, "run-x", 3, cut[0]) == refs[0], "a retried write is the same object"
    store.put_bytes(refs[1].key, store.get_bytes(refs[1].key).replace(b'"m600"', b'"m601"'))
    with pytest.raises(CorruptObject):
        load_samples(store, refs)


def test_a_started_run_carries_a_pointer_to_its_tasks(store):
    config = load_config(None)
    inline = training_input(config, tasks(1000), run_id="big", fork_groups=False)
    stored = tasks_by_reference(store, inline)
    assert stored.tasks == [] and stored.task_set.count == 1000 and stored.task_count == 1000
    assert len(stored.model_dump_json()) < 4096 < len(inline.model_dump_json())
    assert tasks_by_reference(store, stored) is stored


def test_a_run_has_its_tasks_one_way():
    config = load_config(None)
    ref = training_input(config, tasks(4), run_id="r").model_copy(update={"tasks": []})
    with pytest.raises(ValidationError, match="either inline .* or stored"):
        type(ref).model_validate(ref.model_dump())


def test_setups_are_reused_only_for_a_bounded_number_of_tasks():
    config = load_config(None)
    assert training_input(config, tasks(MAX_REUSED_SETUPS)).reuse_setup
    assert not training_input(config, tasks(MAX_REUSED_SETUPS + 1)).reuse_setup
    with pytest.raises(TooManySetups, match="--no-reuse-setup"):
        training_input(config, tasks(MAX_REUSED_SETUPS + 1), reuse_setup=True)
