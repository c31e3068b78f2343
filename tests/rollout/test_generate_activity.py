"""The `generate` activity against a real node and a real S3 (SeaweedFS): prefix refs in,
segment refs out, one logprob and one weights version per token beside the log,
heartbeats that let a retry resume, non-retryable bad input."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from belayer.activities.generate import GenerateArgs, PartialTokens, RolloutActivities, SamplingParams
from belayer.rollout.protocol import SamplingSpec
from belayer.storage.generation import SampledTokens, encode_sampled, read_generation
from belayer.storage.tokenlog import PrefixRef, Span, TokenLog, encode_tokens, read_marks, read_prefix
from tests.rollout.conftest import node_config, pooled_node

PROMPT = list(range(40, 90))
SAMPLING = SamplingParams(max_tokens=48, temperature=0.9, seed=42, ignore_eos=True)


@pytest.fixture(scope="module")
def activity_node(node_pool, tiny_model):
    for nut in pooled_node(node_pool, node_config(weight_mode="private"), tiny_model):
        yield nut.node


def _context(store, key: str) -> PrefixRef:
    log = TokenLog.create(store, key)
    return log.append(PROMPT, source="env")


def _expected_completion(node):
    spec = SamplingSpec(
        max_tokens=SAMPLING.max_tokens, temperature=SAMPLING.temperature, seed=SAMPLING.seed, ignore_eos=True
    )
    return node.generate(PROMPT, spec, timeout=300)


def _expected(node) -> list[int]:
    return _expected_completion(node).token_ids


def _assert_one_logprob_and_version_per_token(store, result) -> tuple[list[float], list[int]]:
    logprobs, versions = read_generation(store, result.generation)
    assert result.generation.start == result.segment_start
    assert len(logprobs) == len(versions) == result.output_tokens == result.generation.count
    assert all(lp <= 0 for lp in logprobs), "a logprob above 0"
    assert result.weights_versions == list(dict.fromkeys(versions))
    return logprobs, versions


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
    fresh = _expected_completion(activity_node)
    assert tokens[: len(PROMPT)] == PROMPT
    assert tokens[len(PROMPT) :] == fresh.token_ids
    assert result.finish_reason == "length" and result.node_queue == "rollout-test-node"
    assert result.timing.total_s >= result.timing.prefill_s >= 0
    logprobs, versions = _assert_one_logprob_and_version_per_token(store, result)
    assert logprobs == pytest.approx(fresh.logprobs, rel=1e-5, abs=1e-6) and versions == fresh.versions
    assert read_marks(store, result.prefix) == [
        Span(0, len(PROMPT), "env"),
        Span(len(PROMPT), result.prefix.length, "model"),
    ]


async def test_heartbeats_carry_a_count_and_a_stored_object_never_token_ids(activity_node, store):
    ref = _context(store, "traj/h")
    acts = RolloutActivities(activity_node, store, "rollout-test-node")
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=0.1))
    beats: list[PartialTokens] = []
    env.on_heartbeat = lambda *details: beats.append(PartialTokens.model_validate(details[-1]))
    sampling = SAMPLING.model_copy(update={"max_tokens": 400})
    result = await env.run(acts.generate, GenerateArgs(prefix=ref, sampling=sampling))
    produced = read_prefix(store, result.prefix)[len(PROMPT) :]
    stored = [b for b in beats if b.key is not None]
    assert stored, f"no heartbeat named stored tokens ({len(beats)} heartbeats)"
    # Each named object held exactly the tokens so far when it was heartbeated; after the
    # turn the object is gone (the token log holds the turn).
    assert [b.tokens for b in stored] == sorted(b.tokens for b in stored) and stored[-1].tokens <= len(
        produced
    )
    assert not store.exists(stored[-1].key)


async def test_retry_resumes_from_heartbeated_tokens(activity_node, store):
    fresh = _expected_completion(activity_node)
    expected = fresh.token_ids
    ref = _context(store, "traj/b")
    acts = RolloutActivities(activity_node, store, "rollout-test-node")
    earlier = SampledTokens(expected[:20] + [7, 7], fresh.logprobs[:20] + [-1.0, -1.0], fresh.versions[:22])
    partial = store.put_bytes("traj/b.partial/earlier-attempt", encode_sampled(earlier))
    env = ActivityEnvironment()
    details = PartialTokens(tokens=20, key=partial.key, sha256=partial.sha256).model_dump()
    env.info = dataclasses.replace(env.info, heartbeat_details=[details], attempt=2)
    result = await env.run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert result.resumed_tokens == 20
    assert read_prefix(store, result.prefix)[len(PROMPT) :] == expected
    # The tokens after the resumed ones were generated after a recovery: the turn, replayed
    # uninterrupted on the same engine, drew them too.
    replay = result.recovery_replay
    assert (replay.position, replay.tokens_after, replay.outcome) == (20, SAMPLING.max_tokens - 20, "same")
    # The turn's record covers the resumed tokens too: theirs from the stored partial, the
    # rest from the engine.
    logprobs, versions = _assert_one_logprob_and_version_per_token(store, result)
    assert logprobs[:20] == pytest.approx(fresh.logprobs[:20], rel=1e-6)
    assert logprobs == pytest.approx(fresh.logprobs, rel=1e-5, abs=1e-6) and versions == fresh.versions


async def test_a_stored_partial_that_does_not_verify_starts_the_turn_over(activity_node, store):
    expected = _expected(activity_node)
    ref = _context(store, "traj/e")
    acts = RolloutActivities(activity_node, store, "rollout-test-node")
    partial = store.put_bytes("traj/e.partial/earlier-attempt", encode_tokens([5] * 20))
    env = ActivityEnvironment()
    forged = PartialTokens(tokens=20, key=partial.key, sha256="0" * 64).model_dump()
    env.info = dataclasses.replace(env.info, heartbeat_details=[forged], attempt=2)
    result = await env.run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert result.resumed_tokens == 0
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
    ref = log.append([1, 2, activity_node.vocab_size + 5], source="env")
    acts = RolloutActivities(activity_node, store, "rollout-test-node")
    with pytest.raises(ApplicationError) as err:
        await ActivityEnvironment().run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert err.value.non_retryable and err.value.type == "BadRequest"
    # the node keeps serving
    assert len(_expected(activity_node)) == SAMPLING.max_tokens


# ------------------------------------------------------------------ through Temporal

from temporalio import workflow  # noqa: E402
from temporalio.common import RetryPolicy  # noqa: E402
from temporalio.exceptions import ActivityError  # noqa: E402

with workflow.unsafe.imports_passed_through():
    from belayer.activities.generate import GenerateResult


@workflow.defn(sandboxed=False)  # this test module imports boto3 and the node at top level
class TwoTurns:
    """Turn 1 on the shared queue, turn 2 on the node's own queue, then a forged ref."""

    @workflow.run
    async def run(self, prefix: PrefixRef, shared_queue: str) -> dict:
        opts = dict(
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=3),
        )
        first = await workflow.execute_activity(
            "generate",
            GenerateArgs(
                prefix=prefix,
                sampling=SamplingParams(max_tokens=300, temperature=0.7, seed=3, ignore_eos=True),
            ),
            result_type=GenerateResult,
            task_queue=shared_queue,
            **opts,
        )
        second = await workflow.execute_activity(
            "generate",
            GenerateArgs(prefix=first.prefix, sampling=SamplingParams(max_tokens=16)),
            result_type=GenerateResult,
            task_queue=first.node_queue,
            **opts,
        )
        forged = first.prefix.model_copy(update={"sha256": "f" * 64})
        try:
            await workflow.execute_activity(
                "generate",
                GenerateArgs(prefix=forged, sampling=SamplingParams(max_tokens=4)),
                result_type=GenerateResult,
                task_queue=shared_queue,
                **opts,
            )
            bad = None
        except ActivityError as err:
            bad = {"type": err.cause.type, "non_retryable": err.cause.non_retryable}
        return {"first": first, "second": second, "bad": bad}


async def test_generate_through_temporal_survives_a_leader_kill(
    activity_node, store, temporal_server, stack_config
):
    import os
    import signal
    import uuid

    from temporalio.worker import Worker

    from belayer.temporal_client import connect

    ref = _context(store, "traj/t")
    suffix = uuid.uuid4().hex[:8]
    shared_queue, node_queue = f"rollout-{suffix}", f"rollout-{suffix}-node"
    acts = RolloutActivities(activity_node, store, node_queue)
    killed = []

    def kill_mid_turn(request_id: str, n: int) -> None:
        if not killed and n >= 100:
            killed.append(activity_node.holders.leader.pid)
            os.kill(killed[0], signal.SIGKILL)

    activity_node.add_progress_listener(kill_mid_turn)
    client = await connect(stack_config.temporal, stack_config.storage.encryption_key)
    try:
        workers = [
            Worker(
                client,
                task_queue=q,
                activities=[acts.generate],
                workflows=[TwoTurns] if q == shared_queue else [],
            )
            for q in (shared_queue, node_queue)
        ]
        async with workers[0], workers[1]:
            out = await client.execute_workflow(
                TwoTurns.run,
                args=[ref, shared_queue],
                id=f"gen-{suffix}",
                task_queue=shared_queue,
                execution_timeout=timedelta(minutes=10),
            )
    finally:
        activity_node.remove_progress_listener(kill_mid_turn)
    first, second = GenerateResult.model_validate(out["first"]), GenerateResult.model_validate(out["second"])
    assert killed, "the leader was never killed"
    assert first.engine_recoveries == ["takeover"] and first.output_tokens == 300
    # From the takeover on (the kill came at the 100th token or soon after) the tokens came
    # from a re-prefilled request; the turn replayed uninterrupted drew the same ones.
    replay = first.recovery_replay
    assert replay.outcome == "same" and 100 <= replay.position < 300, replay
    assert replay.tokens_after == 300 - replay.position
    assert second.recovery_replay is None and second.engine_recoveries == []
    spec = SamplingSpec(max_tokens=300, temperature=0.7, seed=3, ignore_eos=True)
    assert (
        read_prefix(store, first.prefix)[len(PROMPT) :]
        == activity_node.generate(PROMPT, spec, timeout=300).token_ids
    )
    assert second.prefix.length == first.prefix.length + second.output_tokens
    assert second.segment_start == first.prefix.length
    # The turn that survived the takeover mid-way has a logprob and a version for each of its 300 tokens.
    _assert_one_logprob_and_version_per_token(store, first)
    _assert_one_logprob_and_version_per_token(store, second)
    assert out["bad"] == {"type": "CorruptPrefix", "non_retryable": True}
