"""Sandbox errors: one root, specific kinds, messages that name the fix.

`retryable` says whether the same call may succeed later on the same host; the
activity runtime's translator (belayer/activities/runtime.py) maps each kind to a Temporal
ApplicationError type with non_retryable = not retryable.
"""

from __future__ import annotations

from belayer.errors import BelayerError


class SandboxError(BelayerError):
    """Root of every sandbox error."""

    retryable = False

    def details(self) -> dict | None:
        """Small fields the workflow acts on, beside the message (none by default)."""
        return None


class InvalidSandboxId(SandboxError):
    """A sandbox id Belayer would never make (a path, `..`): refused before anything is touched."""


class SandboxNotFound(SandboxError):
    """No container for this sandbox on this host (destroyed, or the host was replaced)."""


# Why a sandbox was lost, as its host found it (`SandboxHost.exec`):
LOST_FROM_OUTSIDE = "outside"  # killed or removed on the host (podman kill, a fence, a drain, a crash)
LOST_TO_OOM = "oom"  # PID 1 killed by the OOM killer of the sandbox's own memory limit
LOST_PID1_EXITED = "pid1-exited"  # PID 1 ended by itself, nothing outside stopped it
LOST_UNEXPLAINED = "unexplained"  # no cause found on either side
CAUSED_BY_AGENT = frozenset({LOST_TO_OOM, LOST_PID1_EXITED})


class SandboxUnreachable(SandboxError):
    """The supervisor does not answer: the container died. Recover from a checkpoint --
    unless the host found the cause inside the sandbox (`cause` in CAUSED_BY_AGENT): then
    what the agent ran broke it, and the trajectory ends as the policy's failure.

    `cause` is None where nobody looked (the channel's own error); `step` is the action
    that was running when the sandbox was lost."""

    def __init__(self, message: str, *, cause: str | None = None, step: int | None = None):
        super().__init__(message)
        self.cause = cause
        self.step = step

    def details(self) -> dict | None:
        return None if self.cause is None else {"cause": self.cause, "step": self.step}


class HostDraining(SandboxError):
    """This host is being drained (it is going away): it starts no sandbox; retried, the
    call goes to another host."""

    retryable = True


class HostFull(SandboxError):
    """This host holds sandbox.max_sandboxes already: it starts no more; retried, or placed
    again, the sandbox goes to a host with room."""

    retryable = True


class StagingFull(SandboxError):
    """The host's staging disk is at its budget (sandbox.staging_budget_mb) with nothing it
    may evict: the checkpoint is not taken; the trajectory goes on unprotected until its next."""


class SandboxBusy(SandboxError):
    """Another action is still running in this sandbox."""

    retryable = True


class StaleGeneration(SandboxError):
    """The handle's generation is not the sandbox's: a restore superseded it."""


class SetupFailed(SandboxError):
    """A task setup command exited non-zero; the message carries its output."""


class SupervisorRefused(SandboxError):
    """The supervisor refused a malformed or out-of-order request."""


class RuntimeUnavailable(SandboxError):
    """podman, runc, CRIU or the base image is missing or broken on this host."""


class PodmanFailed(SandboxError):
    """A podman call failed; the message carries its stderr."""

    retryable = True


class CheckpointFailed(SandboxError):
    """podman/CRIU could not dump the sandbox."""

    retryable = True


class CheckpointBlockedByAgent(CheckpointFailed):
    """The agent kept a process stopped as the dump froze the sandbox, which CRIU cannot
    dump (belayer/sandbox/dump_watchdog.py): the dump was ended, the sandbox thawed and
    running as before. Not retried -- the agent would do it again; the trajectory goes on
    without this checkpoint."""

    retryable = False


class RestoreFailed(SandboxError):
    """No checkpoint could be restored, and replay was not allowed or failed too."""


class CheckpointCorrupt(SandboxError):
    """A checkpoint archive is missing or does not match its recorded sha256."""


class JournalMismatch(SandboxError):
    """A restored sandbox's journal (its head, or an observation up to it) differs from what
    its checkpoint recorded or from the trajectory's log."""


class CheckpointInconsistent(SandboxError):
    """A checkpoint's recorded token prefix is not the trajectory's context at its step: it
    was taken on a branch the context no longer has. Skipped, like a corrupt one."""


class RecoveryImpossible(SandboxError):
    """No checkpoint the recovery may use is left, and replaying from the start would cross a
    point no replay brings back (a multi-step task's stage boundary): not retried."""
