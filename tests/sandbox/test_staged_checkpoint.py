"""A checkpoint in two halves on real sandboxes: captured to a file on the host while the
sandbox is idle, published to the store later, beside the sandbox's next action.

What must hold: the published checkpoint is the state at the capture, whatever the
action between the halves did; a retried publish returns what the first one stored; a
capture that is gone before it was stored says so; nothing captured outlives its sandbox.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from belayer.sandbox.errors import CheckpointCorrupt, StagingFull
from belayer.sandbox.models import Action

TRAJ = "traj-staged"


def act(step: int, command: str) -> Action:
    return Action(trajectory=TRAJ, step=step, command=command)


def test_the_published_checkpoint_is_the_state_at_its_capture_not_after_the_action_between(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    assert (
        host.exec(handle, act(1, "echo one > /workspace/f; sleep 600 & echo $! > /tmp/sleeper")).exit_code
        == 0
    )
    staged = host.capture_checkpoint(handle, token_prefix_len=11, token_prefix_sha256="ab" * 32)
    assert Path(staged.path).is_file() and staged.step == 1
    # The action the publish runs beside: it changes the file and ends the process.
    assert host.exec(handle, act(2, "kill $(cat /tmp/sleeper) && echo two >> /workspace/f")).exit_code == 0
    ref = host.publish_checkpoint(staged)
    assert not Path(staged.path).exists(), "the captured file outlived its publish"
    meta = host.load_meta(ref)
    assert (meta.step, meta.token_prefix_len, meta.token_prefix_sha256) == (1, 11, "ab" * 32)
    assert set(meta.phases) >= {"frozen", "publish"}

    host.kill(handle)
    restored, _ = host.restore(ref, handle.generation + 1)
    probe = host.exec(restored, act(2, "cat /workspace/f; kill -0 $(cat /tmp/sleeper) && echo sleeping"))
    assert probe.stdout == "one\nsleeping\n"


def test_a_retried_publish_returns_the_checkpoint_the_first_one_stored(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    host.exec(handle, act(1, "echo one > /workspace/f"))
    staged = host.capture_checkpoint(handle)
    first = host.publish_checkpoint(staged)
    assert host.publish_checkpoint(staged) == first


def test_a_capture_lost_before_its_publish_says_the_step_is_unprotected(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    host.exec(handle, act(1, "echo one > /workspace/f"))
    staged = host.capture_checkpoint(handle)
    Path(staged.path).unlink()  # the host's disk lost it (a restarted machine)
    with pytest.raises(CheckpointCorrupt, match="never stored"):
        host.publish_checkpoint(staged)
    assert list(host.store.list(staged.base_key)) == []


def test_removing_a_sandbox_deletes_its_unpublished_capture(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    other = sandboxes.create()
    host.exec(handle, act(1, "echo one > /workspace/f"))
    host.exec(other, act(1, "echo one > /workspace/f"))
    staged, kept = host.capture_checkpoint(handle), host.capture_checkpoint(other)
    host.destroy(handle)
    assert not Path(staged.path).exists()
    assert Path(kept.path).is_file(), "another sandbox's capture went with it"
    host.publish_checkpoint(kept)


def test_the_staging_budget_evicts_what_no_trajectory_can_publish_and_refuses_the_rest(sandboxes):
    """Over `sandbox.staging_budget_mb`, a capture first evicts, oldest first, the staged
    checkpoints no trajectory can still publish: one a newer capture of its sandbox
    superseded, one of a sandbox gone from the host. When what is left may all still be
    published, the capture is refused (`StagingFull`) and the sandbox goes on."""
    host = sandboxes.host
    first_box = sandboxes.create()
    host.exec(first_box, act(1, "echo one > /workspace/f"))
    superseded = host.capture_checkpoint(first_box)
    host.exec(first_box, act(2, "echo two >> /workspace/f"))
    newest = host.capture_checkpoint(first_box)
    gone = host.staging.staged_path("sbx-gone-0000--00000004-g0-0123abcd.tar")
    gone.write_bytes(b"a capture whose sandbox left this host")
    os.utime(gone, (1, 1))  # the oldest
    other = sandboxes.create()
    host.exec(other, act(1, "echo other > /workspace/f"))

    host.staging.budget_bytes = 1  # everything is over it
    with pytest.raises(StagingFull, match=r"sandbox.staging_budget_mb.*may still be published"):
        host.capture_checkpoint(other)
    assert [p.name for p in host.staging.staged_dir.iterdir()] == [Path(newest.path).name]
    assert not Path(superseded.path).exists() and not gone.exists()
    assert host.staging.usage().evicted == 2
    assert host.exec(other, act(2, "cat /workspace/f")).stdout == "other\n"  # refused, not broken

    host.staging.budget_bytes = 1 << 30
    assert Path(host.capture_checkpoint(other).path).is_file()
    assert host.load_meta(host.publish_checkpoint(newest)).step == 2  # what a trajectory still needed
