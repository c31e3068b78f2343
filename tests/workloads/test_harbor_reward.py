"""A Harbor verifier's reward files: a scalar always, every named value kept, anything else no reward."""

from __future__ import annotations

import pytest

from belayer.workloads.harbor_reward import NoReward, read_reward


def test_reward_txt_is_the_scalar_and_graded_values_are_rewards():
    assert read_reward("0.25\n", None).reward == 0.25
    both = read_reward("1", '{"tests": 0.5, "style": 1}')
    assert both.reward == 1.0 and both.rewards == {"tests": 0.5, "style": 1.0, "reward": 1.0}


def test_reward_json_reward_key_then_named_key_then_mean():
    assert read_reward(None, '{"reward": 0.75, "x": 0}').reward == 0.75
    assert read_reward(None, '{"a": 0.2, "b": 1.0}', reward_key="a").reward == 0.2
    mean = read_reward(None, '{"a": 0.5, "b": 1, "note": "text", "ok": true}')
    assert mean.reward == 0.75 and mean.rewards == {"a": 0.5, "b": 1.0}


@pytest.mark.parametrize(
    ("txt", "json_text", "key", "expected"),
    [
        (None, None, None, "wrote no reward"),
        ("pass", None, None, "'pass', not a number"),
        ("nan", None, None, "not a finite number"),
        (None, "[1]", None, "must be an object"),
        (None, "{", None, "not valid JSON"),
        (None, '{"note": "x"}', None, "no numeric value"),
        (None, '{"a": 1}', "b", "no numeric 'b'"),
    ],
)
def test_no_reward_says_what_was_written(txt, json_text, key, expected):
    with pytest.raises(NoReward, match=expected):
        read_reward(txt, json_text, key)
