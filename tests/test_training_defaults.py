"""One set of defaults: what `belayer train`, the library (`training_input`), the training
benchmark and the examples train with when nobody says otherwise is the same, read from
one place (`TrainerSettings`, `belayer.training`), so a run started from Python is the
run the command would have started."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from belayer.cli.bench.training import training as bench_training
from belayer.cli.train import start
from belayer.config import load_config
from belayer.trainer.models import TrainerSettings
from belayer.training import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_ITERATIONS,
    DEFAULT_TASKS_PER_ITERATION,
    MAX_DEFAULT_CONCURRENCY,
    default_concurrency,
    training_input,
    tuned,
)
from belayer.workloads.models import TraceTask, TraceTurn, Workload

ROOT = Path(__file__).parents[1]
TRAINER = TrainerSettings()


def defaults(command) -> dict:
    return {param.name: param.default for param in command.params}


def test_belayer_train_and_the_library_train_alike_by_default(tmp_path):
    cli = defaults(start)
    tasks = [TraceTask(id=f"t{i}", turns=[TraceTurn(think_tokens=1, bash="true")]) for i in range(4)]
    untuned = Workload(tasks=tasks)
    assert (
        cli["iterations"],
        tuned("group_size", cli["group_size"], untuned),
        cli["tasks_per_iteration"],
    ) == (
        DEFAULT_ITERATIONS,
        DEFAULT_GROUP_SIZE,
        DEFAULT_TASKS_PER_ITERATION,
    )
    assert (
        tuned("lr", cli["lr"], untuned),
        cli["minibatches"],
        tuned("kl_coef", cli["kl_coef"], untuned),
        cli["algorithm"],
    ) == (
        TRAINER.lr,
        TRAINER.minibatches,
        TRAINER.kl_coef,
        TRAINER.algorithm,
    )
    library = training_input(load_config(state_dir=tmp_path), tasks)
    assert (library.iterations, library.group_size, library.tasks_per_iteration) == (
        DEFAULT_ITERATIONS,
        DEFAULT_GROUP_SIZE,
        DEFAULT_TASKS_PER_ITERATION,
    )
    # the whole iteration at once
    assert (
        cli["concurrency"] is None and library.concurrency == DEFAULT_GROUP_SIZE * DEFAULT_TASKS_PER_ITERATION
    )
    # `--lr-decay linear` (the command's default): to 0 over the run's iterations.
    assert cli["lr_decay"] == "linear" and library.trainer.lr_decay_iterations == library.iterations
    assert (library.trainer.lr, library.trainer.minibatches) == (TRAINER.lr, TRAINER.minibatches)


def test_a_workloads_learning_rate_is_the_default_and_lr_overrides_it_even_with_zero():
    tasks = [TraceTask(id="t", turns=[TraceTurn(think_tokens=1, bash="true")])]
    workload = Workload(tasks=tasks, lr=2e-4)
    assert tuned("lr", None, workload) == 2e-4
    assert tuned("lr", 0.0, workload) == 0.0  # the control run
    assert tuned("lr", 3e-4, Workload(tasks=tasks)) == 3e-4


def test_a_workloads_group_size_and_kl_weight_are_defaults_that_the_flags_override():
    tasks = [TraceTask(id="t", turns=[TraceTurn(think_tokens=1, bash="true")])]
    workload = Workload(tasks=tasks, group_size=8, kl_coef=0.1)
    assert (tuned("group_size", None, workload), tuned("kl_coef", None, workload)) == (8, 0.1)
    assert (tuned("group_size", 2, workload), tuned("kl_coef", 0.0, workload)) == (2, 0.0)
    assert tuned("group_size", None, Workload(tasks=tasks)) == DEFAULT_GROUP_SIZE


def test_an_iteration_runs_all_at_once_by_default_up_to_a_hosts_capacity():
    tasks = [TraceTask(id="t", turns=[TraceTurn(think_tokens=1, bash="true")])]
    assert default_concurrency(32, tasks * 16) == 48 and default_concurrency(6, None) == 6
    assert default_concurrency(256, None) == MAX_DEFAULT_CONCURRENCY


def test_one_temperature_serves_the_rollouts_and_the_trainer(tmp_path):
    config = load_config(state_dir=tmp_path)
    tasks = [TraceTask(id=f"t{i}", turns=[TraceTurn(think_tokens=1, bash="true")]) for i in range(4)]
    alone = training_input(config, tasks, temperature=0.7)
    settings = training_input(config, tasks, settings=TrainerSettings(temperature=0.7))
    assert {(i.temperature, i.trainer.temperature) for i in (alone, settings)} == {(0.7, 0.7)}
    with pytest.raises(ValidationError) as refused:
        training_input(config, tasks, settings=TrainerSettings(temperature=1.0), temperature=0.7)
    message = str(refused.value)
    assert "temperature 0.7" in message and "trainer.temperature 1" in message and "--temperature" in message


def test_retention_keeps_every_checkpoint_unless_asked_and_keep_every_needs_keep_last(tmp_path):
    config = load_config(state_dir=tmp_path)
    tasks = [TraceTask(id=f"t{i}", turns=[TraceTurn(think_tokens=1, bash="true")]) for i in range(4)]
    assert (defaults(start)["keep_last"], training_input(config, tasks).keep_last) == (None, None)
    kept = training_input(config, tasks, keep_last=1, keep_every=3)
    assert [i for i in range(9) if kept.kept(i)] == [2, 5, 8]
    assert not any(training_input(config, tasks, keep_last=2).kept(i) for i in range(9))
    with pytest.raises(ValidationError, match="keep_every without keep_last"):
        training_input(config, tasks, keep_every=3)


def test_the_training_benchmark_and_the_example_train_as_belayer_train_does(monkeypatch, tmp_path):
    assert defaults(bench_training)["lr"] == TRAINER.lr
    example = runpy.run_path(str(ROOT / "examples/train_with_client.py"), run_name="not_main")
    monkeypatch.setattr(sys, "argv", ["train_with_client.py", "w.yaml"])
    args = example["parse_args"]()
    tasks = [TraceTask(id="t", turns=[TraceTurn(think_tokens=1, bash="true")])]
    assert tuned("lr", args.lr, Workload(tasks=tasks)) == TRAINER.lr
    cli = defaults(start)
    assert (args.iterations, args.tasks_per_iteration, args.group_size) == (
        cli["iterations"], cli["tasks_per_iteration"], cli["group_size"]
    )  # fmt: skip
    workload = tmp_path / "tuned.yaml"
    workload.write_text(
        "tasks:\n- {id: t, turns: [{think_tokens: 1, bash: 'true'}]}\ngroup_size: 6\nkl_coef: 0.05\n"
    )
    args.workload, args.tasks_per_iteration = workload, 1
    input = example["run_input"](load_config(state_dir=tmp_path), args)
    assert (input.group_size, input.trainer.kl_coef, input.iterations) == (6, 0.05, DEFAULT_ITERATIONS)
