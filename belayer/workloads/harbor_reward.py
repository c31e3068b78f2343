"""A Harbor verifier's reward, from the files its tests/test.sh wrote in /logs/verifier/.

`reward.txt` (one number) is the scalar. With only `reward.json` (an object), the scalar is
its `reward` key, else the key the user names (`--reward-key`), else the mean of its
numeric values; every numeric value is kept as `rewards`. Graded rewards are first-class:
any finite number is a reward. A verifier that wrote neither, or wrote something that is
no reward, scored nothing: the caller counts that as the agent's failure (reward 0 with
the reason), never as an infrastructure fault to retry.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

REWARD_TXT = "reward.txt"
REWARD_JSON = "reward.json"


@dataclass(frozen=True)
class VerifierReward:
    """The scalar reward and every named value the verifier reported."""

    reward: float
    rewards: dict[str, float] = field(default_factory=dict)


class NoReward(ValueError):
    """The verifier reported no usable reward; the message says what it wrote instead."""


def read_reward(txt: str | None, json_text: str | None, reward_key: str | None = None) -> VerifierReward:
    """The reward from the contents of reward.txt and reward.json (None: the file is absent)."""
    rewards = _json_rewards(json_text) if json_text is not None else {}
    if txt is not None:
        scalar = _number(txt.strip(), REWARD_TXT)
        return VerifierReward(
            reward=scalar, rewards={**rewards, "reward": scalar} if rewards else {"reward": scalar}
        )
    if json_text is None:
        raise NoReward(f"the verifier wrote no reward: neither /logs/verifier/{REWARD_TXT} nor {REWARD_JSON}")
    return VerifierReward(reward=_scalar_of(rewards, reward_key), rewards=rewards)


def _number(text: str, source: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise NoReward(f"{source} holds {text[:40]!r}, not a number") from None
    if not math.isfinite(value):
        raise NoReward(f"{source} holds {text[:40]!r}, not a finite number")
    return value


def _json_rewards(text: str) -> dict[str, float]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NoReward(f"{REWARD_JSON} is not valid JSON ({exc.msg})") from None
    if not isinstance(document, dict):
        raise NoReward(f"{REWARD_JSON} must be an object of named numbers, got {type(document).__name__}")
    return {
        key: float(value)
        for key, value in document.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def _scalar_of(rewards: dict[str, float], reward_key: str | None) -> float:
    if reward_key is not None:
        if reward_key not in rewards:
            raise NoReward(
                f"{REWARD_JSON} has no numeric {reward_key!r} (--reward-key); it has {', '.join(sorted(rewards)) or 'none'}"
            )
        return rewards[reward_key]
    if "reward" in rewards:
        return rewards["reward"]
    if not rewards:
        raise NoReward(f"{REWARD_JSON} holds no numeric value")
    return sum(rewards.values()) / len(rewards)


def task_reward(step_rewards: list[float | None], steps: int, strategy: str = "mean") -> float:
    """A multi-step task's reward from its steps' (None: no reward written): the mean over
    all `steps`, a step not run or without a reward counting 0, or with `final` the last
    step's (0 unless it ran). A single-step task's is its step's."""
    scored = [reward or 0.0 for reward in step_rewards] + [0.0] * (steps - len(step_rewards))
    if strategy == "final":
        return scored[-1]
    return sum(scored) / steps


def judge_check(files: dict[str, bytes], *, timed_out: bool, timeout_s: float | None, exit_code: int,
                reward_key: str | None = None) -> tuple[VerifierReward | None, str]:  # fmt: skip
    """What a verifier's run and the files of its logs directory amount to: its reward, or
    none and why (it timed out; it wrote no usable reward). The one judgement of a graded
    check, for the trajectories' verify activity and `belayer tasks check` alike."""
    if timed_out:
        return None, f"the verifier timed out after {timeout_s:g} s"
    text = {name: data.decode("utf-8", "replace") for name, data in files.items()}
    try:
        return read_reward(text.get(REWARD_TXT), text.get(REWARD_JSON), reward_key), ""
    except NoReward as exc:
        return None, f"{exc} (verifier exit {exit_code})"
