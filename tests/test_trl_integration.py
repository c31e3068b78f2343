"""`belayer.integrations.trl` without a stack: how TRL's prompts become Belayer groups and
back, and the mistakes it refuses with the fix. On the whole stack with TRL's own
GRPOTrainer: tests/training/test_trl_stack.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from belayer.integrations.trl import BelayerRollouts, _in_order, _without_repeats
from belayer.rollouts import Rollout, RolloutError
from belayer.workloads.models import TraceTask, TraceTurn

TASKS = [TraceTask(id=f"t{i}", turns=[TraceTurn(think_tokens=1, bash="true")]) for i in range(3)]


def rollouts() -> BelayerRollouts:
    return BelayerRollouts(TASKS, client=None, loop=None)


def rollout(task_id: str, member: int) -> Rollout:
    return Rollout(task_id=task_id, member=member, status="completed", reward=1.0, rewards={"reward": 1.0},
                   prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], loss_mask=[1], weights_versions=[2],
                   turns=1, recoveries=0, attempts=1, trajectory_id=f"{task_id}-{member}")  # fmt: skip


def trainer(training: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        num_generations=2, num_generations_eval=2, model=SimpleNamespace(training=training),
        state=SimpleNamespace(global_step=0), args=SimpleNamespace(temperature=1.0),
    )  # fmt: skip


def test_each_run_of_num_generations_equal_prompts_is_one_group():
    assert [t.id for t in rollouts()._groups(["t1", "t1", "t0", "t0"], 2)] == ["t1", "t0"]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (["t1", "t0"], "should be one prompt 2 times"),
        (["t1", "t1", "t0"], "are not runs of num_generations=2"),
        (["nope", "nope"], "'nope' is no task id of this BelayerRollouts; use its dataset()"),
    ],
)
def test_prompts_that_are_not_groups_of_known_tasks_are_refused(prompts, message):
    with pytest.raises(RolloutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rollouts()._groups(prompts, 2)


def test_a_task_twice_in_a_generation_batch_goes_to_batches_that_name_it_once():
    t0, t1, _ = TASKS
    assert [[t.id for t in b] for b in _without_repeats([t0, t1, t0, t0])] == [["t0", "t1"], ["t0"], ["t0"]]


def test_rollouts_come_back_in_the_order_of_trls_prompts():
    t0, t1, _ = TASKS
    batches = [
        [rollout("t0", 0), rollout("t0", 1), rollout("t1", 0), rollout("t1", 1)],
        [rollout("t0", 0), rollout("t0", 1)],
    ]
    ordered = _in_order([r for b in batches for r in b], [t1, t0, t0])
    assert [(r.task_id, r.member) for r in ordered] == [
        ("t1", 0),
        ("t1", 1),
        ("t0", 0),
        ("t0", 1),
        ("t0", 0),
        ("t0", 1),
    ]
    assert ordered[2] is batches[0][0] and ordered[4] is batches[1][0]


def test_training_without_the_weight_sync_callback_is_refused_with_the_fix():
    with pytest.raises(RolloutError, match=r"pass callbacks=\[rollouts.weight_sync\(\)\]"):
        rollouts().rollout_func(["t0", "t0"], trainer())


def test_a_task_id_twice_is_refused_since_the_id_is_the_prompt():
    with pytest.raises(RolloutError, match="name an id twice"):
        BelayerRollouts.connect([TASKS[0], TASKS[0]])


def test_the_dataset_has_one_prompt_per_task_its_id():
    assert rollouts().dataset()["prompt"] == ["t0", "t1", "t2"]


def test_the_reward_is_belayers():
    assert rollouts().reward(["a", "b"], belayer_reward=[1.0, 0.0], trajectory=["x", "y"]) == [1.0, 0.0]
