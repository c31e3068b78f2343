"""The checkpoint policy on recorded decision traces, plus property tests."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from belayer.policy.adaptive import CheckpointPolicy, CheckpointSample, GenerationSample
from belayer.policy.config import PolicyConfig
from belayer.policy.simulate import TraceStep, simulate


def adaptive(**overrides) -> PolicyConfig:
    return PolicyConfig(mode="adaptive", **overrides)


def test_long_generation_hides_checkpoint():
    policy = CheckpointPolicy(config=adaptive(alpha=1.5))
    policy.observe_checkpoint(CheckpointSample(duration_s=0.5, size_mb=2.0))
    policy.observe_generation(GenerationSample(output_tokens=200, per_token_s=0.02, total_s=4.0))
    policy.observe_action(0.3)
    decision = policy.decide(step=0, size_mb=2.0)
    assert decision.verdict == "checkpoint"
    assert decision.predicted_generation_s == 4.0
    assert decision.estimated_checkpoint_s == 0.5
    assert policy.unprotected_steps == 0


def test_short_generation_skips_until_the_bound():
    policy = CheckpointPolicy(config=adaptive(max_unprotected_steps=3, max_unprotected_replay_s=1e9))
    policy.observe_checkpoint(CheckpointSample(duration_s=1.0, size_mb=10.0))
    verdicts = []
    for step in range(7):
        policy.observe_generation(GenerationSample(output_tokens=5, per_token_s=0.01, total_s=0.05))
        policy.observe_action(0.1)
        verdicts.append(policy.decide(step=step, size_mb=10.0).verdict)
    assert verdicts == ["skip", "skip", "forced", "skip", "skip", "forced", "skip"]


def test_replay_cost_bound_forces_a_checkpoint():
    policy = CheckpointPolicy(config=adaptive(max_unprotected_steps=100, max_unprotected_replay_s=5))
    policy.observe_generation(GenerationSample(output_tokens=1, per_token_s=0.01, total_s=0.01))
    policy.observe_action(6.0)  # a pip install: expensive to replay
    assert policy.decide(step=0, size_mb=50).verdict == "forced"


def test_expected_output_hint_is_used():
    policy = CheckpointPolicy(config=adaptive())
    policy.observe_generation(GenerationSample(output_tokens=10, per_token_s=0.01, total_s=0.1))
    assert policy.predict_generation_s() == 0.1
    assert policy.predict_generation_s(expected_output_tokens=1000) == 10.0


def test_checkpoint_estimate_scales_with_size_but_keeps_fixed_part():
    policy = CheckpointPolicy(config=adaptive())
    policy.observe_checkpoint(CheckpointSample(duration_s=1.0, size_mb=100))
    assert policy.estimate_checkpoint_s(200) == 2.0
    assert policy.estimate_checkpoint_s(1) == 0.5


def test_failed_checkpoint_leaves_work_unprotected():
    policy = CheckpointPolicy(config=PolicyConfig(mode="every-step"))
    policy.observe_action(1.0)
    policy.observe_action(2.0)
    assert policy.decide(step=1, size_mb=1).checkpointed
    policy.observe_checkpoint_failed()
    assert policy.unprotected_steps == 2
    assert policy.unprotected_replay_s == 3.0


def test_a_checkpoint_still_being_stored_is_skipped_past_and_completes_its_own_decision():
    """The workflow decides after each action without waiting for a publish in flight:
    that decision skips, its step stays unprotected, and the stored checkpoint's figures
    (or its failure) go to the decision that took it, not to the latest."""
    policy = CheckpointPolicy(
        config=adaptive(alpha=1.0, max_unprotected_steps=2, max_unprotected_replay_s=1e9)
    )
    policy.observe_generation(GenerationSample(output_tokens=100, per_token_s=0.01, total_s=1.0))
    policy.observe_action(0.2)
    assert policy.decide(step=1, size_mb=1).verdict == "checkpoint"
    taking = policy.decided
    policy.observe_action(0.3)
    skipped = policy.decide(step=2, size_mb=1, storing_step=1)
    assert skipped.verdict == "skip" and "step 1 is still being stored" in skipped.reason
    policy.observe_action(0.4)
    assert policy.decide(step=3, size_mb=1, storing_step=1).verdict == "skip", "not forced past the bound"
    policy.observe_checkpoint(CheckpointSample(duration_s=0.7, size_mb=1), wait_s=0.1, decision=taking)
    assert policy.decisions[0].actual_checkpoint_s == 0.7 and policy.decisions[0].wait_s == 0.1
    assert [d.actual_checkpoint_s for d in policy.decisions[1:]] == [None, None]
    assert policy.unprotected_steps == 2 and policy.decide(step=4, size_mb=1).verdict == "checkpoint"

    policy.observe_checkpoint_failed(decision=taking)  # had the first one failed instead
    assert policy.unprotected_steps == 1 and policy.decisions[0].reason.endswith("; failed")


def test_decisions_record_actuals_and_predictor_error():
    policy = CheckpointPolicy(config=PolicyConfig(mode="every-step", prior_checkpoint_s=0.6))
    policy.observe_generation(GenerationSample(output_tokens=100, per_token_s=0.01, total_s=1.0))
    policy.observe_action(0.2)
    policy.decide(step=0, size_mb=1)
    policy.observe_generation(GenerationSample(output_tokens=100, per_token_s=0.01, total_s=2.0))
    policy.observe_checkpoint(CheckpointSample(duration_s=0.3, size_mb=1), wait_s=0.0)
    record = policy.decisions[0]
    assert record.actual_generation_s == 2.0
    assert record.actual_checkpoint_s == 0.3
    errors = policy.predictor_error()
    assert errors["generation_mean_rel_error"] == 0.5
    assert round(errors["checkpoint_mean_rel_error"], 6) == 1.0


def test_modes_none_and_every_step():
    for mode, expected in (("none", 0), ("every-step", 6)):
        trace = [TraceStep(output_tokens=10, per_token_s=0.01, action_s=0.1, checkpoint_s=0.5, size_mb=2)] * 6
        assert simulate(trace, PolicyConfig(mode=mode)).checkpoints == expected


def test_policy_state_round_trips_as_workflow_state():
    policy = CheckpointPolicy(config=adaptive())
    policy.observe_generation(GenerationSample(output_tokens=3, per_token_s=0.1, total_s=0.3))
    policy.observe_action(0.1)
    policy.decide(step=0, size_mb=1)
    assert CheckpointPolicy.model_validate_json(policy.model_dump_json()) == policy


@st.composite
def trace_step(draw, staged: bool | None = None) -> TraceStep:
    """One turn; its checkpoint staged (a capture, then a publish) or in one call, drawn
    unless `staged` says."""
    checkpoint_s = draw(st.floats(0.0, 5.0))
    staged = draw(st.booleans()) if staged is None else staged
    return TraceStep(
        output_tokens=draw(st.integers(0, 4000)),
        per_token_s=draw(st.floats(0.0, 0.05)),
        action_s=draw(st.floats(0.0, 20.0)),
        checkpoint_s=checkpoint_s,
        size_mb=draw(st.floats(0.0, 500.0)),
        capture_s=checkpoint_s * draw(st.floats(0.0, 1.0)) if staged else None,
    )


trace_steps = st.lists(trace_step(), min_size=1, max_size=60)
staged_trace_steps = st.lists(trace_step(staged=True), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(
    trace=trace_steps,
    bound=st.integers(1, 10),
    alpha=st.floats(0.1, 10.0),
    mode=st.sampled_from(["none", "every-step", "adaptive"]),
    lengths_known=st.booleans(),
)
def test_bound_respected_and_no_checkpoint_overlaps_an_action(trace, bound, alpha, mode, lengths_known):
    config = PolicyConfig(
        mode=mode,
        alpha=alpha,
        max_unprotected_steps=bound,
        max_unprotected_replay_s=1e12,
        trace_lengths_known=lengths_known,
    )
    timeline = simulate(trace, config)
    if mode != "none":
        assert timeline.max_unprotected_steps <= bound
    actions = [i for i in timeline.intervals if i.kind == "action"]
    checkpoints = [i for i in timeline.intervals if i.kind == "checkpoint"]
    for checkpoint in checkpoints:
        for action in actions:
            overlap = min(checkpoint.end, action.end) - max(checkpoint.start, action.start)
            assert overlap <= 1e-9, (checkpoint, action)


@settings(max_examples=100, deadline=None)
@given(trace=trace_steps)
def test_adaptive_never_costs_more_wall_time_than_every_step(trace):
    adaptive_wall = simulate(trace, adaptive()).wall_s
    every_step_wall = simulate(trace, PolicyConfig(mode="every-step")).wall_s
    assert adaptive_wall <= every_step_wall + 1e-9


def test_adaptive_is_the_default():
    assert PolicyConfig().mode == "adaptive"
    assert CheckpointPolicy().config.mode == "adaptive"


def test_no_next_generation_means_no_bubble_to_hide_in():
    """After the last turn the workflow expects 0 tokens: skip, unless the bound says otherwise."""
    policy = CheckpointPolicy(config=adaptive(max_unprotected_steps=3))
    policy.observe_checkpoint(CheckpointSample(duration_s=0.5, size_mb=2.0))
    policy.observe_generation(GenerationSample(output_tokens=400, per_token_s=0.02, total_s=8.0))
    policy.observe_action(0.1)
    assert policy.decide(step=1, size_mb=2.0, expected_output_tokens=0).verdict == "skip"
    policy.observe_action(0.1)
    policy.observe_action(0.1)
    assert policy.decide(step=3, size_mb=2.0, expected_output_tokens=0).verdict == "forced"


def test_fixed_part_of_a_turn_counts_as_generation_and_as_queueing():
    trace = [
        TraceStep(output_tokens=10, per_token_s=0.1, fixed_s=2.0, action_s=0.1, checkpoint_s=2.5, size_mb=1)
    ] * 3
    timeline = simulate(trace, adaptive(alpha=1.0))
    generations = [i for i in timeline.intervals if i.kind == "generate"]
    assert all(abs((g.end - g.start) - 3.0) < 1e-9 for g in generations)
    assert timeline.checkpoints == 3 and timeline.wait_s == 0.0  # 3 s of generation hides 2.5 s


def test_blind_to_the_trace_lengths_the_policy_predicts_from_history():
    """Told the lengths, the policy hides a checkpoint in the one long generation; blind to
    them, as on a model task, it expects another short one there and skips."""
    trace = [
        TraceStep(output_tokens=tokens, per_token_s=0.01, action_s=0.1, checkpoint_s=1.0, size_mb=1)
        for tokens in (10, 10, 400, 10, 10)
    ]
    assert simulate(trace, adaptive()).checkpoints == 1
    assert simulate(trace, adaptive(trace_lengths_known=False)).checkpoints == 0


def test_trace_lengths_are_known_by_default():
    assert PolicyConfig().trace_lengths_known is True


@settings(max_examples=200, deadline=None)
@given(
    trace=staged_trace_steps, mode=st.sampled_from(["every-step", "adaptive"]), lengths_known=st.booleans()
)
def test_a_publish_runs_beside_the_action_that_started_it_and_adaptive_never_waits_for_one(
    trace, mode, lengths_known
):
    """Staged checkpoints: each publish starts with an action (the one after its capture) or
    at the end; one checkpoint is in flight at a time; adaptive waits only for captures."""
    config = PolicyConfig(mode=mode, trace_lengths_known=lengths_known)
    timeline = simulate(trace, config)
    actions = {i.start for i in timeline.intervals if i.kind == "action"}
    captures = [i for i in timeline.intervals if i.kind == "checkpoint"]
    publishes = [i for i in timeline.intervals if i.kind == "publish"]
    for publish in publishes:
        assert publish.start in actions or publish.end == timeline.wall_s, publish
    for capture, following in itertools.pairwise(captures):
        stored = max([p.end for p in publishes if p.step == capture.step], default=capture.end)
        assert following.start >= stored - 1e-9, (capture, following)
    if mode == "adaptive":
        capture_waits = 0.0
        for capture in captures:
            next_generation = [
                i for i in timeline.intervals if i.kind == "generate" and i.step == capture.step + 1
            ]
            if next_generation:
                capture_waits += max(capture.end - next_generation[0].end, 0.0)
        assert abs(timeline.wait_s - capture_waits) < 1e-6


def test_a_staged_checkpoint_is_waited_for_only_as_long_as_its_capture():
    """A 1 s checkpoint whose capture takes 0.2 s beside a 0.5 s generation: the one-call
    checkpoint holds every action 0.5 s; staged, nothing waits, and the publish runs
    beside the action."""
    turn = dict(output_tokens=50, per_token_s=0.01, action_s=2.0, checkpoint_s=1.0, size_mb=1)
    one_call = simulate([TraceStep(**turn)] * 4, PolicyConfig(mode="every-step"))
    staged = simulate([TraceStep(**turn, capture_s=0.2)] * 4, PolicyConfig(mode="every-step"))
    assert one_call.wait_s == 1.5 and staged.wait_s == 0.0
    assert staged.wall_s == one_call.wall_s - 1.5
    assert [i.kind for i in staged.intervals if i.step == 0] == [
        "generate",
        "action",
        "checkpoint",
        "publish",
    ]


def test_adaptive_skips_past_a_publish_that_outlasts_the_action_and_every_step_waits_for_it():
    turn = TraceStep(
        output_tokens=100, per_token_s=0.01, action_s=0.1, checkpoint_s=0.8, capture_s=0.3, size_mb=1
    )
    adaptive_run = simulate([turn] * 6, adaptive(alpha=1.0))
    every_step = simulate([turn] * 6, PolicyConfig(mode="every-step"))
    assert (
        adaptive_run.checkpoints == 3 and adaptive_run.wait_s == 0.0
    )  # every other step: the publish runs on
    assert every_step.checkpoints == 6 and every_step.wait_s > 0


def test_at_the_bound_the_caller_must_not_skip_past_a_checkpoint_being_stored():
    policy = CheckpointPolicy(config=adaptive(max_unprotected_steps=2, max_unprotected_replay_s=5.0))
    policy.observe_action(0.1)
    assert not policy.at_bound()
    policy.observe_action(0.1)
    assert policy.at_bound()  # two steps
    policy.mark_protected()
    policy.observe_action(6.0)
    assert policy.at_bound()  # 6 s of replay


def test_only_adaptive_short_of_the_bound_goes_ahead_of_a_checkpoint_being_stored():
    policy = CheckpointPolicy(config=adaptive(max_unprotected_steps=2))
    policy.observe_action(0.1)
    assert policy.skips_past_storing()
    policy.observe_action(0.1)
    assert not policy.skips_past_storing()  # at the bound: wait for it, then take one
    decision = policy.decide(2, size_mb=10.0)
    assert (decision.verdict, decision.reason) == ("forced", "2 unprotected steps reach the bound")
    every_step = CheckpointPolicy(config=PolicyConfig(mode="every-step"))
    every_step.observe_action(0.1)
    assert not every_step.skips_past_storing()
