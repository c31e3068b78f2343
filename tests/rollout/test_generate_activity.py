"""The `generate` activity against a real node and a real S3 (SeaweedFS): prefix refs in,
segment refs out, heartbeats that let a retry resume, non-retryable bad input."""

from __future__ import annotations

import dataclasses

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from belayer.activities.generate import GenerateArgs, RolloutActivities, SamplingParams
from belayer.storage.store import ObjectStore
from belayer.storage.tokenlog import PrefixRef, TokenLog, read_prefix
from belayer.workers.rollout.protocol import SamplingSpec
from tests.rollout.conftest import NodeUnderTest, node_config

pytestmark = [pytest.mark.engine, pytest.mark.stack]

PROMPT = list(range(40, 90))
SAMPLING = SamplingParams(max_tokens=48, temperature=0.9, seed=42, ignore_eos=True)


@pytest.fixture(scope="module")
def activity_node(tiny_model):
    nut = NodeUnderTest(node_config(weight_mode="private"), tiny_model)
    try:
        yield nut.start()
    finally:
        left = nut.close()
    assert not left, f"node leaked: {left}"


@pytest.fixture
def store(storage_config):
    with ObjectStore(storage_config) as s:
        yield s


def _context(store, key: str) -> PrefixRef:
    log = TokenLog.create(store, key)
    return log.append(PROMPT)


def _expected(node) -> list[int]:
    spec = SamplingSpec(
        max_tokens=SAMPLING.max_tokens, temperature=SAMPLING.temperature, seed=SAMPLING.seed, ignore_eos=True
    )
    return node.generate(PROMPT, spec, timeout=300).token_ids


async def test_generate_appends_the_turn_to_the_token_log(activity_node, store):
    ref = _context(store, "traj/a")
    acts = RolloutActivities(activity_node, store, "rollout-test-node")
    env = ActivityEnvironment()
    beats = []
    env.on_heartbeat = lambda *details: beats.append(details)
    result = await env.run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert result.prefix.length == len(PROMPT) + SAMPLING.max_tokens == result.prefix.length
    assert result.segment_start == len(PROMPT) and result.output_tokens == SAMPLING.max_tokens
    tokens = read_prefix(store, result.prefix)
    assert tokens[: len(PROMPT)] == PROMPT
    assert tokens[len(PROMPT) :] == _expected(activity_node)
    assert result.finish_reason == "length" and result.node_queue == "rollout-test-node"
    assert result.timing.total_s >= result.timing.prefill_s >= 0


async def test_retry_resumes_from_heartbeated_tokens(activity_node, store):
    expected = _expected(activity_node)
    ref = _context(store, "traj/b")
    acts = RolloutActivities(activity_node, store, "rollout-test-node")
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_details=[expected[:20]], attempt=2)
    result = await env.run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert result.resumed_tokens == 20
    assert read_prefix(store, result.prefix)[len(PROMPT) :] == expected


async def test_prefix_hash_mismatch_is_non_retryable(activity_node, store):
    ref = _context(store, "traj/c")
    forged = ref.model_copy(update={"sha256": "0" * 64})
    acts = RolloutActivities(activity_node, store, "rollout-test-node")
    with pytest.raises(ApplicationError) as err:
        await ActivityEnvironment().run(acts.generate, GenerateArgs(prefix=forged, sampling=SAMPLING))
    assert err.value.non_retryable and err.value.type == "CorruptPrefix"


async def test_token_outside_vocabulary_is_non_retryable(activity_node, store):
    log = TokenLog.create(store, "traj/d")
    ref = log.append([1, 2, activity_node.vocab_size + 5])
    acts = RolloutActivities(activity_node, store, "rollout-test-node")
    with pytest.raises(ApplicationError) as err:
        await ActivityEnvironment().run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert err.value.non_retryable and err.value.type == "BadRequest"
    # the node keeps serving
    assert len(_expected(activity_node)) == SAMPLING.max_tokens
