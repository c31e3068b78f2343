"""The generate activity keeps each token's logprob and weights version beside the token
log, heartbeats included, against a scripted node (no vLLM) and a real S3 (SeaweedFS).
tests/rollout/test_generate_activity.py checks the same on a real engine."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from temporalio.testing import ActivityEnvironment

from belayer.activities import generate as generate_activity
from belayer.activities.context import AppendObservationArgs
from belayer.activities.generate import GenerateArgs, PartialTokens, RolloutActivities, SamplingParams
from belayer.model.build import model_path
from belayer.sandbox.models import Observation, observation_hash
from belayer.sandbox.observations import store_observation
from belayer.storage.errors import CorruptObject
from belayer.storage.generation import SampledTokens, decode_sampled, encode_sampled, read_generation
from belayer.storage.recordlog import RecordLogRef
from belayer.storage.store import open_store
from belayer.storage.tokenlog import Span, TokenLog, encode_tokens, prefix_ref, read_marks, read_prefix
from belayer.trajectory_log import StepRecord, read_steps, start_log, steps_key

PROMPT = list(range(40, 90))
PUBLISHED_AT = len(PROMPT) + 30  # positions from here on are sampled by version 2


def sampled_at(position: int) -> tuple[int, float, int]:
    """What the scripted node samples at an absolute position: (token, logprob, version)."""
    return 100 + position % 50, -(position % 7) / 8, 1 if position < PUBLISHED_AT else 2


def expected(count: int) -> SampledTokens:
    token, logprob, version = zip(*(sampled_at(len(PROMPT) + i) for i in range(count)), strict=True)
    return SampledTokens(list(token), list(logprob), list(version))


class ScriptedHandle:
    """A request that produces a token every `per_token_s`; its logprobs and versions run
    one token ahead of its tokens, as the node's may (the reader must cut them)."""

    def __init__(self, prompt_len: int, max_tokens: int, per_token_s: float):
        self.request_id = f"scripted-{prompt_len}"
        self.sampled = [sampled_at(prompt_len + i) for i in range(max_tokens)]
        self.started, self.per_token_s = time.monotonic(), per_token_s

    def _count(self) -> int:
        if not self.per_token_s:
            return len(self.sampled)
        return min(len(self.sampled), int((time.monotonic() - self.started) / self.per_token_s))

    def tokens_so_far(self) -> list[int]:
        return [t for t, _, _ in self.sampled[: self._count()]]

    def logprobs_so_far(self) -> list[float]:
        return [lp for _, lp, _ in self.sampled[: self._count() + 1]]

    def versions_so_far(self) -> list[int]:
        return [v for _, _, v in self.sampled[: self._count() + 1]]

    def done(self) -> bool:
        return self._count() == len(self.sampled)

    def when_done(self, callback) -> None:
        left = self.per_token_s * len(self.sampled) - (time.monotonic() - self.started)
        threading.Timer(max(left, 0.0) + 0.001, callback).start()

    def result(self, timeout=None):
        tokens, logprobs, versions = (list(column) for column in zip(*self.sampled, strict=True))
        return SimpleNamespace(
            token_ids=tokens,
            logprobs=logprobs,
            versions=versions,
            finish_reason="length",
            prefill_s=0.0,
            decode_s_per_token=self.per_token_s,
            recoveries=(),
            recovered_at=(),
        )


class ScriptedNode:
    """Samples by absolute position, like the real node; a publish lands at PUBLISHED_AT."""

    def __init__(self, per_token_s: float = 0.0):
        self.model_dir = model_path("tiny")
        self.per_token_s = per_token_s
        self.prompts: list[list[int]] = []

    def submit(self, prompt_ids, spec, attempt_id):
        self.prompts.append(list(prompt_ids))
        return ScriptedHandle(len(prompt_ids), spec.max_tokens, self.per_token_s)

    def cancel(self, request_id, reason):
        pass


@pytest.fixture
def store(storage_config):
    with open_store(storage_config, encrypted=False) as s:
        yield s


def context(store, key: str):
    return TokenLog.create(store, key).append(PROMPT, source="env")


SAMPLING = SamplingParams(max_tokens=40, temperature=0.9, seed=1, ignore_eos=True)


async def test_a_turn_stores_one_logprob_and_version_per_token(store):
    ref = context(store, "traj/sc/a")
    acts = RolloutActivities(ScriptedNode(), store, "node-q")
    result = await ActivityEnvironment().run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert read_prefix(store, result.prefix)[len(PROMPT) :] == expected(40).tokens
    assert result.generation.start == len(PROMPT) and result.generation.count == 40
    assert read_generation(store, result.generation) == (expected(40).logprobs, expected(40).versions)
    assert result.weights_versions == [1, 2]
    assert read_marks(store, result.prefix) == [Span(0, len(PROMPT), "env"), Span(len(PROMPT), 90, "model")]


async def test_a_turn_returns_when_its_request_ends_not_at_the_next_heartbeat(store, monkeypatch):
    """Heartbeats an hour apart: the turn still ends with its request (the node wakes the
    activity); before, it slept out the interval (a second per turn on the stack)."""
    monkeypatch.setattr(generate_activity, "MAX_HEARTBEAT_EVERY_S", 3600.0)
    ref = context(store, "traj/sc/w")
    acts = RolloutActivities(ScriptedNode(per_token_s=0.005), store, "node-q")
    turn = ActivityEnvironment().run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    result = await asyncio.wait_for(turn, timeout=120)  # a liveness bound, far below the interval
    assert result.output_tokens == 40


async def test_heartbeated_tokens_carry_their_logprobs_and_versions(store):
    ref = context(store, "traj/sc/h")
    acts = RolloutActivities(ScriptedNode(per_token_s=0.01), store, "node-q")
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=0.1))
    partials: list[SampledTokens] = []

    def on_heartbeat(*details):
        beat = PartialTokens.model_validate(details[-1])
        if beat.key is not None:
            partials.append(decode_sampled(store.get_bytes(beat.key, expected_sha256=beat.sha256)))

    env.on_heartbeat = on_heartbeat
    await env.run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert partials, "no heartbeat named stored tokens"
    for partial in partials:
        assert partial == expected(len(partial))


async def test_a_resumed_turn_records_all_its_tokens(store):
    ref = context(store, "traj/sc/r")
    node = ScriptedNode()
    acts = RolloutActivities(node, store, "node-q")
    earlier = expected(40).first(35)  # an attempt that got past the publish, then died
    stored = store.put_bytes("traj/sc/r.partial/earlier", encode_sampled(earlier))
    env = ActivityEnvironment()
    details = PartialTokens(tokens=33, key=stored.key, sha256=stored.sha256).model_dump()
    env.info = dataclasses.replace(env.info, heartbeat_details=[details], attempt=2)
    result = await env.run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    # the turn went on after the 33 stored tokens; then it was replayed from its start
    assert result.resumed_tokens == 33 and node.prompts == [PROMPT + earlier.tokens[:33], PROMPT]
    assert read_generation(store, result.generation) == (expected(40).logprobs, expected(40).versions)
    assert result.weights_versions == [1, 2]
    # a publish landed inside the turn: its replay, on other weights, says nothing of the tokens
    replay = result.recovery_replay
    assert (replay.position, replay.tokens_after, replay.outcome) == (33, 7, "not_compared")


async def test_a_partial_without_logprobs_starts_the_turn_over(store):
    """Tokens stored by an attempt of the previous release (ids only) cannot resume a turn
    whose record needs logprobs: the turn starts over, with the same tokens."""
    ref = context(store, "traj/sc/o")
    node = ScriptedNode()
    acts = RolloutActivities(node, store, "node-q")
    stored = store.put_bytes("traj/sc/o.partial/earlier", encode_tokens(expected(20).tokens))
    env = ActivityEnvironment()
    details = PartialTokens(tokens=20, key=stored.key, sha256=stored.sha256).model_dump()
    env.info = dataclasses.replace(env.info, heartbeat_details=[details], attempt=2)
    result = await env.run(acts.generate, GenerateArgs(prefix=ref, sampling=SAMPLING))
    assert result.resumed_tokens == 0 and node.prompts == [PROMPT]
    assert read_generation(store, result.generation)[0] == expected(40).logprobs


# ---- a turn that brings the previous action's observation --------------------------------


def an_observed_step(store, trajectory: str, prefix) -> AppendObservationArgs:
    """Step 1 of `trajectory`, its observation stored as the sandbox host stores it, and
    the append that the workflow hands the next generate."""
    observation = Observation(
        exit_code=0,
        stdout="hello from the sandbox",
        stderr="",
        stdout_bytes=22,
        stderr_bytes=0,
        truncated=False,
        binary=False,
        duration_s=0.01,
        timed_out=False,
        shell_respawned=False,
        sha256=observation_hash(0, b"hello from the sandbox", b"", False),
    )
    ref = store_observation(store, trajectory, 1, 0, observation)
    steps = steps_key(trajectory, 0)
    start_log(store, trajectory, steps)
    step = StepRecord(step=1, command="echo hello", observation=ref, context_after_action=prefix)
    return AppendObservationArgs(trajectory_id=trajectory, prefix=prefix, step=step, steps_key=steps)


async def test_a_turn_appends_the_observation_it_brings_then_generates_after_it(store):
    ref = context(store, "traj/sc/obs")
    observed = an_observed_step(store, "traj-obs", ref)
    node = ScriptedNode()
    acts = RolloutActivities(node, store, "node-q")
    result = await ActivityEnvironment().run(
        acts.generate, GenerateArgs(prefix=ref, observation=observed, sampling=SAMPLING)
    )
    after_observation = ref.length + result.observation_tokens
    assert result.observation_tokens > 0 and result.segment_start == after_observation
    assert node.prompts == [read_prefix(store, result.prefix)[:after_observation]]
    assert read_marks(store, result.prefix) == [
        Span(0, after_observation, "env"),
        Span(after_observation, after_observation + 40, "model"),
    ]
    assert read_steps(store, RecordLogRef(key=observed.steps_key, length=1)) == [observed.step]


async def test_the_engine_has_the_turn_before_the_observations_writes_start(store):
    """The generation does not wait for the observation's writes: they start once the
    request is submitted (the node here looks, after giving them time to land)."""
    ref = context(store, "traj/sc/order")
    observed = an_observed_step(store, "traj-order", ref)
    written_at_submit = []

    class LookingNode(ScriptedNode):
        def submit(self, prompt_ids, spec, attempt_id):
            time.sleep(0.5)
            try:
                written_at_submit.append(read_steps(store, RecordLogRef(key=observed.steps_key, length=1)))
            except CorruptObject:  # its record is missing
                written_at_submit.append(None)
            return super().submit(prompt_ids, spec, attempt_id)

    result = await ActivityEnvironment().run(
        RolloutActivities(LookingNode(), store, "node-q").generate,
        GenerateArgs(prefix=ref, observation=observed, sampling=SAMPLING),
    )
    assert written_at_submit == [None]
    assert read_steps(store, RecordLogRef(key=observed.steps_key, length=1)) == [observed.step]
    assert read_marks(store, result.prefix)[0] == Span(0, ref.length + result.observation_tokens, "env")


async def test_an_observation_that_fills_the_context_leaves_no_turn(store):
    ref = context(store, "traj/sc/full")
    observed = an_observed_step(store, "traj-full", ref)
    node = ScriptedNode()
    acts = RolloutActivities(node, store, "node-q")
    result = await ActivityEnvironment().run(
        acts.generate,
        GenerateArgs(prefix=ref, observation=observed, max_context=ref.length + 3, sampling=SAMPLING),
    )
    assert result.output_tokens == 0 and node.prompts == []
    assert result.prefix.length == ref.length + result.observation_tokens > ref.length + 3


def test_an_observation_must_follow_the_turns_prefix(store):
    ref = context(store, "traj/sc/other")
    observed = an_observed_step(store, "traj-other", ref)
    with pytest.raises(ValueError, match="appended after this turn's prefix"):
        GenerateArgs(prefix=prefix_ref("traj/sc/other", PROMPT[:-1]), observation=observed, sampling=SAMPLING)
