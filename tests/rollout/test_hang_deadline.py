"""The leader's hang deadline follows its step times: decode steps and prefill per token."""

import pytest

from belayer.rollout.hang import FLOOR_S, MULTIPLE, HangDeadline

CEILING, BEAT = 60.0, 0.25


def test_unseen_steps_get_the_ceiling_then_the_derived_deadline():
    hang = HangDeadline(CEILING, BEAT)
    assert hang.deadlines(set()).current_s == CEILING
    hang.stepped(0.02, 0, ["a"])
    assert hang.deadlines(set()).current_s == FLOOR_S  # a fast engine: the floor, not 60 s
    for _ in range(10):
        hang.stepped(1.5, 0, ["a"])  # a big model, or a loaded machine
    assert hang.deadlines(set()).current_s == pytest.approx(MULTIPLE * 1.5 + BEAT)


def test_pending_prompts_add_their_prefill_at_the_recent_cost_per_token():
    hang = HangDeadline(CEILING, BEAT)
    hang.stepped(0.1, 0, ["a"])
    hang.sent("b", 1000)
    assert hang.deadlines({"b"}).current_s == CEILING  # prefill never seen: no estimate yet
    hang.stepped(0.5, 100, ["b"])  # its first token: 100 uncached prompt tokens, 0.4 s past a decode step
    hang.sent("c", 2000)
    expected = MULTIPLE * (0.1 + 2000 * 0.004) + BEAT
    assert hang.deadlines({"c"}).pending_prefill_tokens == 2000
    assert hang.deadlines({"c"}).current_s == pytest.approx(expected)
    # c aborted (or re-sent under a new id after a recovery): no longer pending
    assert hang.deadlines(set()).current_s == FLOOR_S


def test_a_turns_few_uncached_tokens_are_not_charged_a_whole_decode_step():
    """Multi-turn prompts: the prefix cache holds a turn's context, so a step prefills the
    few new tokens beside the batch's decoding. Their cost is what the step took beyond
    decoding; charged the whole step, six pending prompts put the deadline at the ceiling
    and a hung engine went unnoticed for 60 s."""
    hang = HangDeadline(CEILING, BEAT)
    for _ in range(10):
        hang.stepped(0.14, 0, ["a"])  # the batch decoding
    for turn in range(20):
        hang.stepped(0.16, 15, [f"turn{turn}"])  # 15 new tokens: 0.02 s past decoding
    hang.stepped(0.5, 300, ["first"])  # a first prompt: 300 tokens, 0.36 s past decoding
    per_token = (20 * 0.02 + 0.36) / (20 * 15 + 300)
    for member in range(6):
        hang.sent(f"m{member}", 300)  # six members' prompts, counted whole
    deadlines = hang.deadlines({f"m{member}" for member in range(6)})
    assert deadlines.prefill_s_per_1k_tokens == pytest.approx(per_token * 1000)
    assert deadlines.current_s == pytest.approx(MULTIPLE * (0.14 + 1800 * per_token) + BEAT)
    assert deadlines.current_s < CEILING / 4


def test_the_setting_bounds_the_deadline():
    hang = HangDeadline(5.0, BEAT)
    hang.stepped(10.0, 0, ["a"])
    assert hang.deadlines(set()).current_s == 5.0
    assert HangDeadline(1.0, BEAT).floor_s == 1.0  # a ceiling below the floor wins
