"""The trainer's step against the real object store and the tiny model: it learns, it is
exact across memory, checkpoints and processes, and it is idempotent."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import torch
from safetensors.torch import load_file

from belayer.config import plain_dump
from belayer.model.build import model_path
from belayer.storage.weights import load_weights
from belayer.trainer.models import StartWeightsArgs
from belayer.trainer.state import decode_checkpoint, platform_of
from belayer.trainer.step import Trainer, TrainRequestError

from .conftest import batch, group, step_args


@pytest.fixture(scope="module")
def trainer():
    return Trainer(device="cpu")


def run() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def built_weights() -> dict:
    return load_file(str(model_path("tiny") / "model.safetensors"))


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_changes_the_weights_and_lr_zero_leaves_them(trainer, store):
    samples = batch(store)
    result = trainer.step(store, step_args(run(), samples))
    assert (result.samples, result.trained_tokens, result.skipped) == (5, 45, [])
    assert result.resumed_from == "built model" and result.checkpoint.weights_version == 2
    assert result.engine_logprob_drift is not None and result.loss == result.loss  # not NaN
    assert not same_tensors(load_weights(store, result.checkpoint.weights), built_weights())
    frozen = trainer.step(store, step_args(run(), samples, lr=0.0))
    assert same_tensors(load_weights(store, frozen.checkpoint.weights), built_weights())
    assert frozen.weights_sha256 != result.weights_sha256


def test_several_minibatches_clip_and_measure_the_kl(trainer, store):
    result = trainer.step(
        store, step_args(run(), batch(store), lr=3e-2, minibatches=3, kl_coef=0.1, clip_eps=0.05)
    )
    assert result.kl > 0 and result.clip_fraction > 0
    assert result.trained_tokens == 45


def test_the_kl_reference_is_the_runs_own_model_whatever_the_process_served_before(store):
    """One trainer process serves runs of different models: a run's KL term is to its own
    model's initial weights, not to those of the first model the process loaded."""
    samples = batch(store)
    alone = Trainer(device="cpu").step(store, step_args(run(), samples, model="tiny-warm", kl_coef=0.1))
    shared = Trainer(device="cpu")
    shared.step(store, step_args(run(), samples, kl_coef=0.1))  # a run of `tiny` first
    after = shared.step(store, step_args(run(), samples, model="tiny-warm", kl_coef=0.1))
    assert alone.kl == 0.0  # the first minibatch's policy is the reference itself
    assert (after.kl, after.weights_sha256) == (alone.kl, alone.weights_sha256)


def test_a_step_from_a_loaded_checkpoint_equals_one_from_memory(trainer, store):
    first_run = run()
    first = trainer.step(store, step_args(first_run, batch(store), minibatches=2))
    second_batch = group(store, "later", [0.0, 1.0, 1.0], version=2, seed=7)
    in_memory = trainer.step(
        store, step_args(first_run, second_batch, iteration=1, base=first.checkpoint, minibatches=2)
    )
    loaded = Trainer(device="cpu").step(
        store, step_args(run(), second_batch, iteration=1, base=first.checkpoint, minibatches=2)
    )
    assert (in_memory.resumed_from, loaded.resumed_from) == ("memory", "checkpoint")
    assert in_memory.weights_sha256 == loaded.weights_sha256
    assert in_memory.checkpoint.weights_version == 3


def test_a_sample_that_does_not_verify_costs_its_group_not_the_step(trainer, store):
    samples = batch(store)  # groups g0 (3 members) and g1 (2)
    damaged = samples[3].context.model_copy(update={"sha256": "0" * 64})
    with_damage = [*samples[:3], samples[3].model_copy(update={"context": damaged}), samples[4]]
    result = trainer.step(store, step_args(run(), with_damage))
    assert result.samples == 3 and [s.group for s in result.skipped] == ["g1"], result.skipped
    assert "member g1-0's token log does not verify" in result.skipped[0].reason
    intact_only = trainer.step(store, step_args(run(), samples[:3]))
    assert result.weights_sha256 == intact_only.weights_sha256, "the step of the intact group alone"


def test_a_checkpoint_records_its_platform_and_another_platform_does_not_resume_it(
    trainer, store, monkeypatch
):
    """Another device, torch or CPU ISA steps the same state to other bytes: a run written
    on one is not silently continued on another."""
    first = trainer.step(store, step_args(run(), batch(store)))
    recorded = decode_checkpoint(first.checkpoint.key, store.get_bytes(first.checkpoint.key)).platform
    assert recorded == platform_of(torch.device("cpu")) and recorded["torch"] == torch.__version__
    elsewhere = recorded | {"cpu_isa": "AMX" if recorded["cpu_isa"] != "AMX" else "AVX2"}
    monkeypatch.setattr("belayer.trainer.step.platform_of", lambda _device: elsewhere)
    later = group(store, "later", [0.0, 1.0, 1.0], version=2, seed=7)
    with pytest.raises(
        TrainRequestError, match=rf"cpu_isa '{recorded['cpu_isa']}' there, '{elsewhere['cpu_isa']}' here"
    ):
        Trainer(device="cpu").step(store, step_args(run(), later, iteration=1, base=first.checkpoint))


def test_the_same_step_in_another_process_gives_the_same_weights(trainer, store, storage_config):
    args = step_args(run(), batch(store))
    here = trainer.step(store, args)
    script = (
        "import json, sys\n"
        "from belayer.storage.config import StorageConfig\n"
        "from belayer.storage.store import open_store\n"
        "from belayer.trainer.models import TrainStepArgs\n"
        "from belayer.trainer.step import Trainer\n"
        "given = json.loads(sys.stdin.read())\n"
        "store = open_store(StorageConfig.model_validate(given['storage']), encrypted=False)\n"
        "print(Trainer(device='cpu').step(store, TrainStepArgs.model_validate(given['args'])).weights_sha256)\n"
    )
    other = args.model_copy(update={"run_id": run()})
    given = {
        "storage": plain_dump(storage_config, reveal_secrets=True),
        "args": other.model_dump(mode="json"),
    }
    out = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(given), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == here.weights_sha256


def test_a_finished_iteration_answers_a_retry_without_training(trainer, store):
    args = step_args(run(), batch(store))
    first = trainer.step(store, args)
    for retry in (trainer.step(store, args), Trainer(device="cpu").step(store, args)):
        assert retry.resumed_from == "already done" and retry.train_s == 0.0
        assert retry.model_dump(exclude={"resumed_from", "train_s"}) == first.model_dump(
            exclude={"resumed_from", "train_s"}
        )


def test_a_group_sampled_by_another_version_is_skipped_whole(trainer, store):
    current = group(store, "current", [1.0, 0.0])
    stale = group(store, "stale", [0.0, 1.0, 0.5], version=3)
    mixed = trainer.step(store, step_args(run(), current + stale))
    alone = trainer.step(store, step_args(run(), current))
    assert [s.group for s in mixed.skipped] == ["stale"] and "version(s) [3]" in mixed.skipped[0].reason
    assert (mixed.samples, mixed.trained_tokens) == (2, 18)
    assert mixed.weights_sha256 == alone.weights_sha256


def test_only_model_tokens_carry_gradient(trainer, store):
    """A trajectory without model tokens changes nothing; a batch of only those takes no
    optimizer step, yet the iteration still gets its checkpoint and version."""
    current = group(store, "learns", [1.0, 0.0])
    silent = group(store, "silent", [1.0, 0.0], model_turns=(0, 0))
    with_silent = trainer.step(store, step_args(run(), silent[:1] + current + silent[1:], weight_decay=0.1))
    without = trainer.step(store, step_args(run(), current, weight_decay=0.1))
    assert with_silent.weights_sha256 == without.weights_sha256
    nothing = trainer.step(store, step_args(run(), silent, weight_decay=0.1))
    assert (nothing.trained_tokens, nothing.samples, nothing.checkpoint.weights_version) == (0, 2, 2)
    assert same_tensors(load_weights(store, nothing.checkpoint.weights), built_weights())


def test_a_run_started_above_version_one_steps_the_versions_it_is_given(trainer, store):
    """Nodes that served another run get the built model back as a new version (6 here):
    the samples carry 6, the step publishes 7, and a state/sample mismatch is refused."""
    from belayer.trainer.step import TrainRequestError

    samples = batch(store, version=6)
    args = step_args(run(), samples).model_copy(update={"sampled_version": 6})
    result = trainer.step(store, args)
    assert (result.checkpoint.weights_version, result.skipped, result.samples) == (7, [], 5)
    later = step_args(
        args.run_id, group(store, "g2", [0.0, 1.0], version=7), iteration=1, base=result.checkpoint
    )
    assert trainer.step(store, later).checkpoint.weights_version == 8
    with pytest.raises(TrainRequestError, match="drawn with weights version 5, but the trainer's state"):
        trainer.step(store, later.model_copy(update={"run_id": run(), "sampled_version": 5}))


def test_a_runs_start_is_stored_from_the_trainers_own_model_once(trainer, store):
    """Version 0 of a run is what the trainer steps from, stored for the nodes to load (they
    check its sha256): the built model's tensors, the same object however often it is asked, and
    never another version's weights passed off as the start."""
    args = StartWeightsArgs(run_id=run(), model="tiny", version=4)
    ref = trainer.start_weights(store, args)
    assert ref.key == f"runs/{args.run_id}/weights/v4.safetensors"
    assert same_tensors(load_weights(store, ref), built_weights())
    assert trainer.start_weights(store, args) == ref  # a retried activity: the same object
    trained = trainer.step(store, step_args(args.run_id, batch(store)))  # stores its weights as v2
    with pytest.raises(TrainRequestError, match="weights v2 are already stored and are not the tiny"):
        trainer.start_weights(store, args.model_copy(update={"version": trained.checkpoint.weights_version}))
