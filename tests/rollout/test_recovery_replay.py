"""Where a turn's tokens after an engine recovery begin, and what a replay of the turn says
about them: the rules behind `GenerateResult.recovery_replay` (the real engine's side is in
test_generate_activity.py and tests/workflows/test_engine_failure.py)."""

from __future__ import annotations

from belayer.activities.generate import compare_replay, first_recovery
from belayer.storage.generation import SampledTokens


def _sampled(tokens: list[int], version: int = 0) -> SampledTokens:
    return SampledTokens(tokens, [-0.5 - i for i in range(len(tokens))], [version] * len(tokens))


def test_a_turn_no_recovery_interrupted_has_no_recovery_position():
    assert first_recovery(0, ()) is None
    assert first_recovery(0, (0,)) is None  # a takeover before its first token: prefilled as ever


def test_the_first_recovery_counts_resumed_tokens_and_in_node_recoveries_after_them():
    assert first_recovery(20, ()) == 20  # a retried attempt went on after its predecessor's 20
    assert first_recovery(0, (7, 30)) == 7  # two takeovers in the node, after 7 and 30 of its tokens
    assert first_recovery(20, (5,)) == 20  # the resumed tokens come first in the turn


def test_a_replay_drawing_the_same_tokens_says_so():
    kept = _sampled([5, 6, 7, 8, 9])
    replay = compare_replay(kept, _sampled([5, 6, 7, 8, 9]), at=2)
    assert (replay.outcome, replay.position, replay.tokens_after, replay.first_difference) == (
        "same",
        2,
        3,
        None,
    )


def test_a_flipped_token_is_flagged_at_its_position_with_both_logprobs():
    kept, replayed = _sampled([5, 6, 7, 8, 9]), _sampled([5, 6, 7, 4, 4])
    replay = compare_replay(kept, replayed, at=2)
    assert replay.outcome == "differs" and replay.first_difference == 3
    assert replay.detail == "token 3: kept 8 (logprob -3.500000), the replay drew 4 (logprob -3.500000)"


def test_a_replay_that_ends_sooner_or_later_differs_where_the_shorter_ends():
    replay = compare_replay(_sampled([5, 6, 7]), _sampled([5, 6, 7, 8]), at=1)
    assert replay.outcome == "differs" and replay.first_difference == 3
    assert replay.detail.startswith("token 3: kept nothing (it ended there)")


def test_tokens_of_other_weights_are_not_compared():
    kept = _sampled([5, 6, 7], version=1)
    assert compare_replay(kept, _sampled([5, 6, 7], version=2), at=1).outcome == "not_compared"
    mixed = SampledTokens([5, 6, 7], [-1.0] * 3, [1, 1, 2])  # a publish landed mid-turn
    assert compare_replay(mixed, mixed, at=1).outcome == "not_compared"
