"""TRL's GRPOTrainer (the real package) with Belayer as its rollout backend, on the whole
stack: TRL trains on exactly Belayer's tokens, masks and logprobs, every step's weights
reach the node before the next batch samples, and a run with an engine crash and a
sandbox crash ends on the same weights as the run without them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from belayer.model.build import model_path
from belayer.workloads.loader import load_workload

ROOT = Path(__file__).parents[2]
LEARN = ROOT / "examples/workloads/learn.yaml"
EXAMPLE = ROOT / "examples/trl_grpo.py"

pytest.importorskip("trl")


@pytest.fixture
def stack_env(stack, monkeypatch):
    """The stack's configuration in this process's environment, as a user's trainer reads it.
    Afterwards the node serves the built model's bytes again, as a new version, so the
    tests after these find it as they would without them."""
    config, env = stack
    for name, value in env.items():
        if name.startswith("BELAYER_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    yield config, env
    asyncio.run(publish_the_built_model())


async def publish_the_built_model() -> None:
    from safetensors.torch import load_file

    from belayer import RolloutClient

    client = await RolloutClient.connect()
    built = model_path(client.config.rollout.model, client.config.cache_dir)
    version = max((await client.served_versions()).values()) + 1
    await client.publish(load_file(str(built / "model.safetensors")), version)


def test_trl_trains_on_belayers_tokens_masks_and_logprobs_and_syncs_each_step(stack_env):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from belayer.integrations.trl import BelayerRollouts

    torch.set_num_threads(1)
    rollouts = BelayerRollouts.connect(load_workload(LEARN).tasks[:2], seed=3)
    config = rollouts.client.config  # the stack's, as the environment gives it
    built = model_path(config.rollout.model, config.cache_dir)
    seen: list[dict] = []

    class Watched(GRPOTrainer):
        """What TRL trains each step with, and the logprobs its model gives those tokens."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            with torch.no_grad():
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    model, ids, mask, inputs["completion_ids"].size(1)
                )
            seen.append({
                "completion_ids": inputs["completion_ids"], "trained": inputs["completion_mask"] * inputs["tool_mask"],
                "engine_logps": inputs["sampling_per_token_logps"], "trainer_logps": logps,
            })  # fmt: skip
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = Watched(
        model=AutoModelForCausalLM.from_pretrained(str(built), dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(str(built)),
        args=GRPOConfig(
            output_dir=str(config.state_dir / "trl-test"),
            max_steps=2,
            learning_rate=1e-4,
            seed=3,
            per_device_train_batch_size=4,
            num_generations=2,
            temperature=1.0,
            bf16=False,  # the engines sample in fp32
            beta=0.0,
            use_cpu=True,
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            disable_tqdm=True,
        ),  # fmt: skip
        train_dataset=rollouts.dataset(),
        reward_funcs=rollouts.reward,
        rollout_func=rollouts.rollout_func,
        callbacks=[rollouts.weight_sync()],
    )
    try:
        trainer.train()
        served = rollouts._run(rollouts.client.served_versions())
    finally:
        rollouts.close()

    assert len(rollouts.batches) == len(seen) == 2
    first = rollouts.version - 2
    assert set(served.values()) == {first + 2}, served  # the weights after the last step
    for step, (batch, trained) in enumerate(zip(rollouts.batches, seen, strict=True)):
        assert len(batch) == 4 and {r.task_id for r in batch} <= set(rollouts.tasks)
        logged = trainer.state.log_history[step]
        assert logged["reward"] == pytest.approx(sum(r.reward for r in batch) / 4)  # Belayer's rewards
        for rollout, row in zip(batch, rows_of(batch, trained["completion_ids"]), strict=True):
            n = len(rollout.completion_ids)
            # TRL's loss mask is Belayer's: the environment's tokens never train.
            assert trained["trained"][row].tolist() == rollout.loss_mask + [0] * (
                trained["trained"].size(1) - n
            )
            assert 0 < sum(rollout.loss_mask) < n, "a multi-turn rollout has tokens of both"
            model_tokens = torch.tensor(rollout.loss_mask, dtype=torch.bool)
            # Sampled from the version the step before published, and scored alike by TRL.
            assert {v for v, m in zip(rollout.weights_versions, rollout.loss_mask, strict=True) if m} == {
                first + step
            }
            engine = trained["engine_logps"][row, :n][model_tokens]
            # Two members can draw the same tokens; their rows are then interchangeable, and
            # their logprobs agree to the batch's summation order, not bit for bit.
            expected = torch.tensor(rollout.logprobs)[model_tokens].to(engine.dtype)
            assert torch.allclose(engine, expected, rtol=0, atol=1e-5), (engine - expected).abs().max()
            drift = (trained["trainer_logps"][row, :n][model_tokens] - engine).abs().max().item()
            assert drift < 1e-4, f"step {step} row {row}: TRL's logprobs differ from the engine's by {drift}"


def rows_of(batch, completion_ids: torch.Tensor) -> list[int]:
    """The row of TRL's (shuffled) batch that holds each rollout's completion, each row once
    (members with the same completion take the rows that hold it in any order)."""
    free = list(range(completion_ids.size(0)))
    rows = []
    for rollout in batch:
        n = len(rollout.completion_ids)
        row = next((r for r in free if completion_ids[r, :n].tolist() == rollout.completion_ids), None)
        assert row is not None, f"TRL's batch has no row of {rollout.trajectory_id}'s completion"
        free.remove(row)
        rows.append(row)
    return rows


def run_example(env, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--json", *args],
        env=env | {"PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"},
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


def test_trl_weights_are_identical_through_an_engine_crash_and_a_sandbox_crash(stack_env):
    _, env = stack_env
    env = os.environ | env
    steps = ("--max-steps", "3", "--tasks-per-step", "2", "--group-size", "2", "--seed", "1")
    calm = run_example(env, *steps)
    faulted = run_example(env, *steps, "--chaos", "engine-crash@iteration=1,sandbox-crash@iteration=2")
    print("trl runs:", json.dumps({"calm": calm, "faulted": faulted}))
    assert [f["kind"] for f in faulted["faults"]] == ["engine-crash", "sandbox-crash"]
    assert all(not f["recovered_by"].startswith("not injected") for f in faulted["faults"]), faulted["faults"]
    assert len({s["weights_sha256"] for s in calm["steps"]}) > 1, (
        "the weights never changed: nothing to compare"
    )
    assert faulted["steps"] == calm["steps"]
    assert faulted["final_weights_sha256"] == calm["final_weights_sha256"]
