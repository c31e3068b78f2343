"""`belayer train --logdir`: iteration records as TensorBoard event files, read back with
TensorBoard's own reader."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from belayer.report.tensorboard import EventLog, rewards_by_family, task_family
from belayer.workflows.training_models import IterationRecord

SHA = "0" * 64


def record(iteration: int, *, entropy: float | None = 1.5) -> IterationRecord:
    weights = {"key": f"runs/r/weights/v{iteration + 2}.safetensors", "size": 1, "sha256": SHA}
    return IterationRecord.model_validate(
        {
            "iteration": iteration,
            "tasks": ["learn-sum-01", "learn-sum-02", "trace"],
            "rewards": [[1.0, 0.0], [1.0, None], [0.5, 0.5]],
            "actions": [[3, 4], [3, None], [2, 2]],
            "mean_reward": 0.6,
            "heldout_reward": None,
            "groups_kept": 3,
            "groups_dropped": 0,
            "infra_retries": 1,
            "weights_version": iteration + 2,
            "weights_sha256": SHA,
            "checkpoint": {"iteration": iteration, "key": "k", "sha256": SHA, "weights": weights,
                           "weights_version": iteration + 2},
            "loss": 0.25 * (iteration + 1),
            "kl": 0.0,
            "clip_fraction": 0.1,
            "trained_tokens": 120,
            "entropy": entropy,
            "grad_norm": 0.75,
            "lr": 1e-4,
            "response_tokens": 20.0,
            "trainer_resumed_from": "memory",
            "rollout_s": 3.0,
            "train_s": 1.0,
            "publish_s": 0.5,
        }
    )  # fmt: skip


def test_a_task_family_is_its_id_without_a_trailing_number():
    assert [task_family(t) for t in ("learn-sum-07", "learn_sum_7", "c-rle-make", "v2", "42")] == [
        "learn-sum",
        "learn_sum",
        "c-rle-make",
        "v",
        "42",
    ]
    assert rewards_by_family(record(0)) == {"learn-sum": pytest.approx(2 / 3), "trace": 0.5}


def test_each_iteration_is_written_once_with_every_metric(tmp_path):
    events = EventLog(tmp_path, "run-a")
    events.write([record(0)])
    events.write([record(0), record(1, entropy=None)])  # a record seen again is not written again
    events.close()
    read = EventAccumulator(str(tmp_path / "run-a"))
    read.Reload()
    tags = set(read.Tags()["scalars"])
    assert {"reward/mean", "reward/family/learn-sum", "reward/family/trace", "train/entropy", "train/grad_norm",
            "train/lr", "train/clip_fraction", "train/kl", "rollout/response_tokens"} <= tags  # fmt: skip
    assert "reward/heldout" not in tags  # no held-out tasks: no curve of zeros
    assert [(e.step, e.value) for e in read.Scalars("train/loss")] == [(0, 0.25), (1, 0.5)]
    assert [e.step for e in read.Scalars("train/entropy")] == [0]  # None is not a value
    assert [e.value for e in read.Scalars("rollout/actions_per_trajectory")] == [pytest.approx(14 / 5)] * 2
