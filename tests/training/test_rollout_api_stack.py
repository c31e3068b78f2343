"""The rollout API (`belayer.RolloutClient`) on the session's whole stack, as a trainer of
its own uses it: groups of the learn tasks sampled by the real vLLM node in forked podman
sandboxes, the built model's weights published as a new version, and batches pinned to a
version. The batch mechanics (retries, streaming, names) are tested in seconds on
stand-ins: tests/test_rollout_api.py.

Every token is checked against what the stack wrote independently of the API's own reader:
the prompt against the prompt template, each model turn's end against the trajectory's
step records, each observation against the observation stored for that step."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tokenizers import Tokenizer

from belayer import Rollout, RolloutClient
from belayer.agent_format import OBSERVATION_TEMPLATE, PROMPT_TEMPLATE, observation_text
from belayer.model.build import model_path
from belayer.rollouts import RolloutError
from belayer.sandbox.observations import load_observation
from belayer.storage.recordlog import RecordLogRef
from belayer.storage.store import open_store
from belayer.trajectory_log import StepRecord, read_steps, steps_key
from belayer.workloads.loader import load_workload

ROOT = Path(__file__).parents[2]
LEARN = ROOT / "examples/workloads/learn.yaml"
SEED = 11


@pytest.fixture
async def client(stack, monkeypatch) -> RolloutClient:
    """A client as a user's trainer makes one: `connect()` reads the configuration the
    stack's `belayer` commands read (its env: private ports, the node, tiny-warm)."""
    _, env = stack
    for name, value in env.items():
        if name.startswith("BELAYER_"):
            monkeypatch.setenv(name, value)
    return await RolloutClient.connect()


def served_version(client: RolloutClient) -> int:
    """The version the node serves, as it records it (tests/training/test_training_stack.py)."""
    config = client.config
    roles = config.state_dir / "run" / f"rollout-{config.rollout.node_id}.roles.json"
    return json.loads(roles.read_text())["weights_version"]


async def test_groups_are_sampled_published_to_and_pinned_on_the_whole_stack(client):
    config = client.config
    built = model_path(config.rollout.model, config.cache_dir)
    tasks = load_workload(LEARN).tasks[:2]
    before = served_version(client)

    # The built model's own weights as a new version: the bytes the node started from, so
    # the tests after this one (a training run publishes the built model again as its
    # first version, whatever the node served) find the node as they would without it.
    version = before + 1
    published = await client.publish(load_file(str(built / "model.safetensors")), version=version)
    assert [(r.version, r.previous_version) for r in published] == [(version, before)]

    first = await client.generate(tasks, group_size=2, seed=SEED, weights_version=version)
    again = await client.generate(tasks, group_size=2, seed=SEED, weights_version=version)
    assert [(r.task_id, r.member) for r in first] == [(t.id, m) for t in tasks for m in range(2)]
    assert [r.completion_ids for r in first] == [r.completion_ids for r in again], "same seed, same rollouts"

    tokenizer = Tokenizer.from_file(str(built / "tokenizer.json"))
    store = open_store(config.storage)  # step records and observations are encrypted at rest
    with contextlib.closing(store):
        for rollout, task in zip(first, [t for t in tasks for _ in range(2)], strict=True):
            assert rollout.status in ("completed", "failed_policy") and rollout.attempts == 1, rollout.reason
            assert rollout.reward in (0.0, 1.0)
            prompt = tokenizer.encode(
                PROMPT_TEMPLATE.format(instruction=task.instruction), add_special_tokens=False
            )
            assert rollout.prompt_ids == prompt.ids and task.instruction in tokenizer.decode(
                rollout.prompt_ids
            )
            assert_tokens_are_the_trajectorys(
                rollout, read_trajectory_steps(store, rollout), tokenizer, store
            )
            assert_model_tokens_sampled_by(rollout, version)
    assert any(r.turns for r in first), "no tool call to check an observation of: pick another SEED"
    assert any(lp < 0.0 for r in first for lp in r.logprobs), "the engine's logprobs, not placeholders"

    with pytest.raises(RolloutError, match=rf"asks for weights v{before} but \S+ serves v{version}"):
        await client.generate(tasks, group_size=2, seed=SEED, weights_version=before)


def read_trajectory_steps(store, rollout: Rollout) -> list[StepRecord]:
    """The steps the trajectory logged (its first context branch: nothing here cuts one)."""
    assert rollout.recoveries == 0, "a recovery may cut the context onto another branch"
    return read_steps(store, RecordLogRef(key=steps_key(rollout.trajectory_id, 0), length=rollout.turns))


def assert_tokens_are_the_trajectorys(rollout: Rollout, steps: list[StepRecord], tokenizer, store) -> None:
    """The completion is model turn, observation, model turn, ...: mask 1 exactly on the
    turns, each ending where its step record says the action ended, each followed by the
    tokens of that step's stored observation; a last turn without a tool call (the model
    stopped) has no observation after it."""
    offset = len(rollout.prompt_ids)
    turns = model_spans(rollout.loss_mask)
    stopped = len(turns) == len(steps) + 1
    assert len(turns) == len(steps) or (stopped and turns[-1][1] == len(rollout.loss_mask)), (turns, steps)
    assert turns[0][0] == 0, "the completion starts with the model's first turn"
    ends = [*(start for start, _ in turns[1:]), len(rollout.completion_ids)]
    for (_, end), next_start, step in zip(turns[: len(steps)], ends[: len(steps)], steps, strict=True):
        assert offset + end == step.context_after_action.length, f"step {step.step} ends elsewhere"
        observation = OBSERVATION_TEMPLATE.format(
            body=observation_text(load_observation(store, step.observation))
        )
        assert (
            rollout.completion_ids[end:next_start]
            == tokenizer.encode(observation, add_special_tokens=False).ids
        )


def assert_model_tokens_sampled_by(rollout: Rollout, version: int) -> None:
    for mask, logprob, sampled_by in zip(
        rollout.loss_mask, rollout.logprobs, rollout.weights_versions, strict=True
    ):
        if mask:
            assert logprob <= 0.0 and sampled_by == version
        else:
            assert (logprob, sampled_by) == (0.0, -1)


def model_spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans
