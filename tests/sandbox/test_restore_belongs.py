"""A restore checks that the checkpoint belongs to the trajectory's current branch.

A trajectory whose context was cut at step k continues on a new branch; a checkpoint taken
after step k on the discarded branch holds a journal and files the new context never saw.
Restoring it would answer the new branch with old observations. `recover` must skip it
(recorded in its notes) whether its recorded token prefix gives it away, or only its
journal does (a log that records no contexts, as the benchmarks pass).
"""

from __future__ import annotations

import pytest

from belayer.sandbox.models import Action, LoggedAction

TRAJ = "traj-branch"
COMMANDS = ["mkdir -p /workspace/w && cd /workspace/w && echo one", "date +%s%N | tee stamp"]


def _prefix(step: int, branch: str) -> tuple[int, str]:
    """A stand-in for the context after `step` on `branch` (length, sha256)."""
    return 100 * step, (branch * 64)[:64]


def _logged(step: int, obs_sha: str, branch: str | None) -> LoggedAction:
    length, sha = _prefix(step, branch) if branch else (None, None)
    return LoggedAction(trajectory=TRAJ, step=step, command=COMMANDS[step - 1], observation_sha256=obs_sha,
                        token_prefix_len=length, token_prefix_sha256=sha)  # fmt: skip


@pytest.fixture
def branches(sandboxes):
    """Branch a: steps 1-2 run and checkpointed after step 2. Branch b: the sandbox lost and
    replayed from the start, step 2 (the clock) answered differently: the context was cut
    there and goes on with b's observation."""
    host = sandboxes.host
    handle = sandboxes.create()
    log_a = []
    for step, command in enumerate(COMMANDS, start=1):
        obs = host.exec(handle, Action(trajectory=TRAJ, step=step, command=command))
        log_a.append(_logged(step, obs.sha256, "a"))
    length, sha = _prefix(2, "a")
    ckpt_a = host.checkpoint(handle, token_prefix_len=length, token_prefix_sha256=sha)
    host.kill(handle)
    replayed = host.recover(handle, [], log_a)
    assert replayed.mismatch_step == 2, replayed
    b_obs = replayed.mismatch_observation.sha256
    host.kill(replayed.handle)
    return host, replayed.handle, ckpt_a, log_a, b_obs


def test_checkpoint_of_a_discarded_branch_is_skipped_by_its_token_prefix(branches):
    host, handle, ckpt_a, log_a, b_obs = branches
    log_b = [log_a[0], _logged(2, b_obs, "b")]
    outcome = host.recover(handle, [ckpt_a], log_b)
    assert outcome.source == "replay-from-start", outcome
    assert any("discarded branch" in n and ckpt_a.meta_key in n for n in outcome.notes), outcome.notes


def test_checkpoint_of_a_discarded_branch_is_skipped_by_its_journal(branches):
    host, handle, ckpt_a, log_a, b_obs = branches
    log_b = [_logged(1, log_a[0].observation_sha256, None), _logged(2, b_obs, None)]  # no contexts recorded
    outcome = host.recover(handle, [ckpt_a], log_b)
    assert outcome.source == "replay-from-start", outcome
    assert any("restored journal" in n and "step 2" in n for n in outcome.notes), outcome.notes
    # The skipped restore left nothing running but the fresh sandbox.
    assert host.backend.containers_of(handle.sandbox_id) == [outcome.handle.container]


def test_checkpoint_of_the_current_branch_passes_both_checks(branches):
    host, handle, ckpt_a, log_a, _ = branches
    outcome = host.recover(handle, [ckpt_a], log_a)
    assert outcome.source == f"checkpoint@{ckpt_a.step}" and outcome.consistent, outcome
    assert outcome.notes == []
