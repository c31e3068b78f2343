"""Forged sandbox handles, and an object store reached with the wrong credentials: a clear,
typed error every time, nothing run in the wrong place, nothing retried forever.

(Stale generations after a restore are tested in tests/sandbox/test_sandbox.py.)
"""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from belayer.sandbox.errors import SandboxError, StaleGeneration
from belayer.sandbox.models import Action
from belayer.storage.errors import PermanentStorageError
from belayer.storage.store import open_store


def act(step: int, command: str, trajectory: str = "t-hostile") -> Action:
    return Action(trajectory=trajectory, step=step, command=command, timeout_s=10)


def test_forged_handles_are_refused_and_run_nothing(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    host.exec(handle, act(1, "echo genuine > /workspace/mark"))
    forged = [
        handle.model_copy(update={"sandbox_id": "sbx-doesnotexist"}),
        handle.model_copy(update={"sandbox_id": "../../../tmp"}),
        handle.model_copy(update={"generation": handle.generation + 5}),  # a future generation
    ]
    for step, bad in enumerate(forged, start=2):
        with pytest.raises(SandboxError) as err:
            host.exec(bad, act(step, "echo forged >> /workspace/mark"))
        assert str(err.value), bad
    with pytest.raises(StaleGeneration):
        host.checkpoint(handle.model_copy(update={"generation": handle.generation + 1}))
    after = host.exec(handle, act(9, "cat /workspace/mark"))
    assert after.stdout == "genuine\n"  # no forged action ran


def test_a_replayed_action_id_cannot_smuggle_a_new_command(sandboxes):
    """Same (trajectory, step), different command: the journal answers with the first
    observation; the second command never runs."""
    host = sandboxes.host
    handle = sandboxes.create()
    first = host.exec(handle, act(1, "echo one > /workspace/f; echo one"))
    again = host.exec(handle, act(1, "echo two > /workspace/f; echo two"))
    assert again.stdout == first.stdout == "one\n"
    assert host.exec(handle, act(2, "cat /workspace/f")).stdout == "one\n"


@pytest.mark.parametrize("field", ["access_key", "secret_key"])
def test_wrong_s3_credentials_are_a_permanent_error_naming_the_setting(storage_config, field):
    wrong = storage_config.model_copy(update={field: SecretStr("not-the-right-one"), "max_attempts": 3})
    with open_store(wrong, encrypted=False) as store:
        for operation in (lambda: store.put_bytes("hostile/x", b"x"), lambda: store.get_bytes("hostile/x")):
            with pytest.raises(PermanentStorageError) as err:
                operation()
            message = str(err.value)
            assert "access_key" in message or "secret_key" in message or "credential" in message.lower(), (
                message
            )
            assert "not-the-right-one" not in message  # a secret is never echoed
