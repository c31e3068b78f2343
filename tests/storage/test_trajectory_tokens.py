"""Where two runs of one trajectory part: the diagnosis a soak and the tests print."""

from __future__ import annotations

from belayer.storage.trajectory_tokens import TrajectoryTokens, where_they_part


def run(tokens: list[int], mask: list[int], logprobs: list[float | None] | None = None) -> TrajectoryTokens:
    logprobs = logprobs or [-0.5 if m else None for m in mask]
    return TrajectoryTokens(tokens, mask, [3 if m else None for m in mask], logprobs)


def test_an_observation_that_differs_is_named_as_the_environments():
    said = where_they_part(run([1, 2, 7, 8], [0, 1, 0, 0]), run([1, 2, 7, 9], [0, 1, 0, 0]))
    assert said.startswith("tokens part at position 3 of 4 and 4") and "in an observation" in said


def test_a_generated_token_that_differs_shows_both_logprobs():
    said = where_they_part(
        run([1, 5, 6], [0, 1, 1], [None, -0.1, -0.69]), run([1, 5, 4], [0, 1, 1], [None, -0.1, -0.70])
    )
    assert (
        "position 2" in said
        and "in a generated token: 6 (logprob -0.69, v3) against 4 (logprob -0.7, v3)" in said
    )


def test_equal_runs_and_a_run_that_goes_on_are_told_apart():
    assert where_they_part(run([1, 2], [0, 1]), run([1, 2], [0, 1])) == "no token differs"
    assert where_they_part(run([1, 2], [0, 1]), run([1, 2, 3], [0, 1, 0])).startswith(
        "one ends at position 2"
    )
    assert "one generated and the other observed" in where_they_part(run([1, 2], [0, 1]), run([1, 3], [0, 0]))
