"""Serialisable sandbox data: handles, actions, observations, checkpoint metadata.

These cross process boundaries (Temporal payloads, object-store JSON), so they are
pydantic models with bounded, documented fields. No I/O here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer.sandbox.errors import InvalidSandboxId

SETUP_TRAJECTORY = "__setup__"
RecoveryMode = Literal["full", "replay", "fs-only"]

# Every sandbox id Belayer makes: `sbx-` and 12 hex digits (host.create, the workflows), or
# a fork's `sbx-<name>-<token>` (benchmarks). No '/', no '.': an id is always one path
# component, a netns name, a container name and a store key component, never a way out.
SANDBOX_ID_PATTERN = r"^sbx-[0-9a-z-]{4,40}$"
_SANDBOX_ID = re.compile(SANDBOX_ID_PATTERN)
SandboxId = Annotated[str, Field(pattern=SANDBOX_ID_PATTERN, description="Lineage id: sbx-[0-9a-z-]{4,40}.")]


def checked_sandbox_id(sandbox_id: str) -> str:
    """`sandbox_id` when it has the form Belayer gives ids; `InvalidSandboxId` otherwise.
    For ids that reach the host without a model's validation (a direct call, a copied
    handle), before any file, container or store key is built from them."""
    if not isinstance(sandbox_id, str) or not _SANDBOX_ID.fullmatch(sandbox_id):
        raise InvalidSandboxId(
            f"sandbox id {sandbox_id!r} is not one Belayer makes (sbx- then 4 to 40 of a-z, 0-9 and '-'): "
            "refused before any file, container or checkpoint is touched"
        )
    return sandbox_id


def path_under(root: Path | str, name: str) -> Path:
    """`root/name` for a name built from a sandbox id, refused (`InvalidSandboxId`) unless it
    stays inside `root` as written (`..`, an absolute name or a '/' cannot lead out)."""
    base = os.path.normpath(root)
    path = os.path.normpath(os.path.join(base, name))
    if os.path.dirname(path) != base or name in ("", ".", ".."):
        raise InvalidSandboxId(f"{name!r} would leave {base}: refused")
    return Path(path)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SandboxHandle(_Model):
    """What the workflow holds: never the resource, only where and which generation."""

    sandbox_id: SandboxId = Field(description="Stable id of the sandbox lineage (survives restores).")
    host_queue: str = Field(description="Task queue of the sandbox host that runs it now.")
    generation: int = Field(ge=0, description="Bumped on every restore; stale handles are refused.")
    container: str = Field(description="Container name on that host (sandbox id + generation).")


class Action(_Model):
    """One agent command, identified by (trajectory, step)."""

    trajectory: str = Field(min_length=1, max_length=200, description="Trajectory id.")
    step: int = Field(ge=1, description="Step number within the trajectory (1-based).")
    command: str = Field(max_length=1 << 20, description="Bash text run in the persistent shell.")
    timeout_s: float | None = Field(
        None, gt=0, le=86400, description="Per-action timeout; default from config."
    )


class LoggedAction(Action):
    """An action as the trajectory logged it, with the hash of the observation it produced."""

    observation_sha256: str = Field(description="Observation.sha256 recorded when the action first ran.")
    token_prefix_len: int | None = Field(
        None, ge=0, description="Context length after this action: what a checkpoint after this step records."
    )
    token_prefix_sha256: str | None = Field(None, description="Hash of that context (a restore checks it).")


class Observation(_Model):
    """What one action produced. Text fields are safe to show a model (invalid UTF-8 escaped)."""

    exit_code: int = Field(description="Exit status; 128+N when killed by signal N; 124 on timeout.")
    stdout: str = Field(description="Captured stdout, UTF-8 with invalid bytes as \\xNN escapes.")
    stderr: str = Field(description="Captured stderr, same encoding.")
    stdout_bytes: int = Field(ge=0, description="Bytes the action wrote to stdout (before the cap).")
    stderr_bytes: int = Field(ge=0, description="Bytes the action wrote to stderr (before the cap).")
    truncated: bool = Field(description="Some output was dropped by the cap (a marker says where).")
    binary: bool = Field(description="The output was not valid UTF-8.")
    duration_s: float = Field(ge=0, description="Wall time of the action inside the sandbox.")
    timed_out: bool = Field(description="The action hit its timeout and was killed.")
    shell_respawned: bool = Field(
        description="The action's shell ended without handing on its state (killed on timeout, replaced by "
        "exec): the next action starts from the state of the action before; `note` says so."
    )
    note: str = Field("", description="What the supervisor did beyond running the command.")
    replayed_from_journal: bool = Field(
        False, description="A repeated action id: this is the journaled observation, nothing ran."
    )
    sha256: str = Field(description="Hash of exit code, raw stdout/stderr and timeout flag (not timings).")

    @classmethod
    def from_supervisor(cls, obs: dict, replayed: bool) -> Observation:
        out = base64.b64decode(obs["stdout"]["b64"])
        err = base64.b64decode(obs["stderr"]["b64"])
        sha = observation_hash(int(obs["exit_code"]), out, err, bool(obs["timed_out"]))
        if obs.get("compacted"):
            # An old journal entry whose output was dropped to make room: its hash stands.
            sha = obs["sha256"]
        elif obs.get("sha256") not in (None, sha):
            raise ValueError("the supervisor's observation hash disagrees with its bytes")
        binary = False
        texts = []
        for raw in (out, err):
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                binary = True
                texts.append(raw.decode("utf-8", "backslashreplace"))
        return cls(
            exit_code=int(obs["exit_code"]),
            stdout=texts[0],
            stderr=texts[1],
            stdout_bytes=int(obs["stdout"]["total"]),
            stderr_bytes=int(obs["stderr"]["total"]),
            truncated=bool(obs["stdout"]["dropped"] or obs["stderr"]["dropped"]),
            binary=binary,
            duration_s=float(obs["duration_s"]),
            timed_out=bool(obs["timed_out"]),
            shell_respawned=bool(obs["shell_respawned"]),
            note=str(obs.get("note", ""))
            + ("; output dropped from the journal to make room (hash kept)" if obs.get("compacted") else ""),
            replayed_from_journal=replayed,
            sha256=sha,
        )


def message_observation(text: str) -> dict:
    """An observation no command produced, as the supervisor reports and journals one: what
    Belayer itself tells the agent (a multi-step task's next stage). `Observation.from_supervisor`
    reads it, and hashes it as any action's output."""
    data = text.encode()
    stream = {"b64": base64.b64encode(data).decode(), "total": len(data), "dropped": 0}
    empty = {"b64": "", "total": 0, "dropped": 0}
    return {"exit_code": 0, "stdout": stream, "stderr": empty, "duration_s": 0.0, "timed_out": False,
            "shell_respawned": False, "note": "", "sha256": observation_hash(0, data, b"", False)}  # fmt: skip


class ObservationRef(_Model):
    """What crosses Temporal of an observation: where it is stored, its hashes, and the few
    facts the workflow decides on. The text itself stays in the object store."""

    key: str = Field(description="Object key of the stored Observation (JSON).")
    object_sha256: str = Field(description="sha256 of the stored object, checked on every read.")
    sha256: str = Field(description="Observation.sha256: what replay-verify compares.")
    exit_code: int
    duration_s: float = Field(ge=0)
    timed_out: bool
    truncated: bool
    replayed_from_journal: bool


def observation_hash(exit_code: int, stdout: bytes, stderr: bytes, timed_out: bool) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([exit_code, timed_out, len(stdout), len(stderr)]).encode())
    h.update(stdout)
    h.update(stderr)
    return h.hexdigest()


class StoredFiles(_Model):
    """A directory of a task's (its tests, its solution) packed as a tar in the object store;
    a host installs it into a sandbox with the supervisor's `install` (never the image's tar)."""

    key: str = Field(min_length=1, description="Object key of the tar.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Checked as the host downloads it.")


class ImageSemantics(_Model):
    """A task's own image run as it was built (Harbor tasks), not as Belayer's sandboxes are.

    The agent's actions run as the image's user (its USER, root when unset, or the task's
    `[agent].user`) in its WORKDIR, with the image's and the task's environment; the root
    file system is writable (installs, /app); the check runs as `verifier_user`. Belayer's
    own programs still run from the read-only toolchain, PID 1 keeps the journal to itself,
    and every user the agent may be holds no capability."""

    workdir: str = Field(pattern=r"^/", description="The agent's cwd and the tree hashed at the end.")
    agent_user: str | None = Field(
        None, description="name, uid, name:group or uid:gid; None: the image's USER."
    )
    verifier_user: str = Field("0", description="Who runs the tests (Harbor's default: root).")
    env: dict[str, str] = Field(default_factory=dict, description="Added to the image's environment.")
    memory_mb: int | None = Field(
        None, ge=16, description="The sandbox's memory limit (None: sandbox.memory_mb)."
    )
    cpus: float | None = Field(None, gt=0, description="Its CPU limit (None: sandbox.cpus).")
    uploads: dict[str, StoredFiles] = Field(
        default_factory=dict,
        description="Absolute path -> files installed there at create, before the setup commands (the "
        "oracle's /solution): they are in every checkpoint of the sandbox.",
    )


class SandboxSpec(_Model):
    """What a new sandbox starts from: the base image plus the task's setup commands."""

    setup_commands: list[str] = Field(default_factory=list, description="Run in order in the agent shell.")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra container labels (tests tag here)."
    )
    image: str | None = Field(
        None,
        description="A task's own image (built by belayer/sandbox/images.py) instead of sandbox.image; a host "
        "that lacks it fetches it from the object store, where the first host to run it put it.",
    )
    semantics: ImageSemantics | None = Field(
        None, description="How `image` is run when it is a task's own (None: as Belayer's base image)."
    )


class CheckpointMeta(_Model):
    """Stored next to each archive as meta.json; a restore trusts nothing else."""

    sandbox_id: SandboxId
    trajectory: str | None = Field(description="Trajectory the sandbox serves (None before any action).")
    step: int = Field(ge=0, description="Journal head when the checkpoint was taken.")
    generation: int = Field(ge=0, description="Supervisor generation inside the archive.")
    token_prefix_len: int | None = Field(None, ge=0, description="Token count of the context at this step.")
    token_prefix_sha256: str | None = Field(None, description="Hash of that token prefix.")
    archive_key: str
    archive_sha256: str
    archive_bytes: int = Field(ge=0)
    fs_key: str | None = Field(None, description="File-system-only snapshot (fs-only baseline), if taken.")
    fs_sha256: str | None = None
    image: str
    image_id: str
    criu_version: str
    podman_version: str
    compression: str
    netns: str | None = Field(
        None,
        description="Network namespace name the archive's config pointed at: checkpoints made before the "
        "sandboxes' user namespaces (none since: each container gets its own namespace).",
    )
    channel_dir: str = Field(description="Bind-mount source of the supervisor channel.")
    created_at: float
    dump_s: float = Field(ge=0, description="Seconds podman/CRIU took to dump and stream the archive.")
    phases: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds per phase of dump_s: freeze, frozen, dump, archive (podman's, see "
        "podman.dump_phases) and upload_tail (the upload after the last archive byte). "
        "For reports only.",
    )


class CheckpointRef(_Model):
    """What the workflow keeps of a checkpoint: pointers and hashes only. The hashes pin
    what a restore may use: meta.json must name the same archive and file-system snapshot."""

    meta_key: str
    step: int = Field(ge=0)
    archive_sha256: str
    archive_bytes: int = Field(ge=0)
    fs_sha256: str | None = Field(
        None, description="sha256 of the file-system snapshot (fs-only baseline), when one was taken."
    )


class StagedCheckpoint(_Model):
    """A checkpoint captured to a file on its host and not yet in the store: what the
    publish step needs (docs/design.md §7). It names a local file, so only the host that
    captured it can publish it; the store key is fixed at capture, so a retried publish
    finds the checkpoint it already wrote."""

    sandbox_id: SandboxId
    trajectory: str | None
    step: int = Field(ge=0, description="Journal head at the capture.")
    generation: int = Field(ge=0)
    token_prefix_len: int | None = Field(None, ge=0)
    token_prefix_sha256: str | None = None
    base_key: str = Field(description="Store prefix the archive and meta.json go under.")
    path: str = Field(description="The plain archive on the capturing host.")
    capture_s: float = Field(ge=0, description="Seconds the capture took (freeze, dump, archive).")
    phases: dict[str, float] = Field(default_factory=dict, description="podman's phases of the capture.")
    image: str | None = Field(None, description="The image the sandbox runs (None: sandbox.image).")


class ForkTarget(_Model):
    """One sandbox to start from another lineage's checkpoint: its id and the trajectory it
    serves (its journal answers that trajectory's inherited steps and refuses the parent's)."""

    sandbox_id: SandboxId = Field(description="The fork's own lineage id.")
    trajectory: str = Field(min_length=1, max_length=200, description="Trajectory the fork serves.")


class ForkOutcome(_Model):
    """What became of one fork: a handle, or why it could not start (nothing left running)."""

    sandbox_id: SandboxId
    handle: SandboxHandle | None = None
    error: str | None = Field(None, description="The failure, typed: '<ErrorType>: message'.")
    ready_s: float = Field(0.0, ge=0, description="From the start of the fork call until this one was ready.")
    closed_tcp_connections: int = Field(
        0,
        ge=0,
        description="Established TCP sockets of the checkpoint this fork started with closed (their "
        "ends saw a reset): a connection cannot have two owners. Listening sockets are kept.",
    )


class RecoverOutcome(_Model):
    """Result of recover(): the new handle, where the sandbox came from, and consistency."""

    handle: SandboxHandle
    mode: RecoveryMode = Field(description="The mode requested.")
    source: str = Field(description="'checkpoint@<step>', 'fs@<step>' or 'replay-from-start'.")
    restored_step: int = Field(ge=0, description="Step the sandbox was at before replay.")
    replayed_steps: int = Field(ge=0)
    consistent: bool = Field(description="Every replayed observation matched the log.")
    consistent_at: int = Field(ge=0, description="Last step known to match (n when consistent).")
    mismatch_step: int | None = Field(None, description="First step whose observation differs.")
    mismatch_observation: Observation | None = Field(None, description="The new observation at that step.")
    notes: list[str] = Field(default_factory=list, description="Fallbacks taken, and why.")
    drained_checkpoint: CheckpointRef | None = Field(
        None,
        description="The checkpoint a drain took, when the sandbox came back from it: the workflow keeps it "
        "among its own, so a second loss starts from it too rather than from an older one.",
    )
    restore_s: float = Field(ge=0, description="Time to get a running sandbox (restore or create).")
    replay_s: float = Field(ge=0, description="Time spent replaying actions.")
