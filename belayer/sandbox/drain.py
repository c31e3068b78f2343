"""Draining a sandbox host before it goes away (a spot preemption, a scale-down).

A drain (`belayer drain HOST`, or SIGTERM to the host's sandbox worker) first stops the
host taking new sandboxes (its worker leaves the shared queue), then moves every
sandbox on it off at its next safe point: it waits for the action in flight to end
(the sandbox's lock), checkpoints the sandbox, records that checkpoint under
`<checkpoint_prefix><sandbox id>/drained/g<generation>.json`, and removes the
container. The trajectory's next call on this host is answered SandboxNotFound
("moved by a drain"); the workflow answers a lost sandbox as always, with a recover on
another host (placement no longer names this one) that starts from the drain's
checkpoint (`SandboxHost.recover` looks the record up), so nothing is replayed.
A sandbox still busy at the deadline is killed instead ("fell back"): its trajectory
recovers from its last checkpoint, as after a crash.

The drain's checkpoint records no token prefix: the host does not know the context.
It needs none. The record is of the generation the workflow holds, and every action a
generation ran belongs to the trajectory's current branch (a cut of the context always
starts a new generation); the restore still checks the journal's observations against
the step log, and the workflow's own checkpoints stay the fallback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer.sandbox.models import CheckpointRef, SandboxId
from belayer.storage.errors import ObjectNotFound, StorageError

if TYPE_CHECKING:
    from belayer.sandbox.host import SandboxHost

log = logging.getLogger(__name__)

DIR = "drained/"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DrainRecord(_Model):
    """Where the drain of `host_queue` left generation `generation` of a sandbox."""

    sandbox_id: SandboxId
    generation: int = Field(ge=0)
    host_queue: str
    checkpoint: CheckpointRef


class DrainedSandbox(_Model):
    """What the drain did with one sandbox."""

    sandbox_id: SandboxId
    outcome: Literal["moved", "fell-back", "gone"] = Field(
        description="moved: checkpointed and removed, its trajectory resumes elsewhere from that checkpoint; "
        "fell-back: not idle before the deadline, killed, its trajectory recovers from its last checkpoint; "
        "gone: it ended or moved on before the drain reached it."
    )
    step: int | None = Field(None, description="The journal head the drain's checkpoint holds.")
    waited_s: float = Field(0.0, ge=0, description="Until its action in flight ended (its safe point).")
    paused_s: float = Field(0.0, ge=0, description="Frozen and unavailable here: the checkpoint and removal.")
    detail: str = ""


class DrainReport(_Model):
    host_queue: str
    deadline_s: float
    sandboxes: list[DrainedSandbox] = Field(default_factory=list)
    emptied_s: float | None = Field(
        None, description="From the drain's start until no sandbox was left here."
    )
    answered: int = Field(0, description="Moved sandboxes whose trajectory was told (its next call here).")

    def counts(self) -> dict[str, int]:
        out = {"moved": 0, "fell-back": 0, "gone": 0}
        for s in self.sandboxes:
            out[s.outcome] += 1
        return out


def record_key(checkpoint_prefix: str, sandbox_id: str, generation: int) -> str:
    return f"{checkpoint_prefix}{sandbox_id}/{DIR}g{generation:010d}.json"


def write_record(store, checkpoint_prefix: str, record: DrainRecord) -> None:
    store.put_bytes(record_key(checkpoint_prefix, record.sandbox_id, record.generation),
                    record.model_dump_json().encode())  # fmt: skip


def find_record(store, checkpoint_prefix: str, sandbox_id: str, generation: int) -> DrainRecord | None:
    """The drain record of that generation, or None (never drained, or unreadable: the
    recovery then starts from the workflow's own checkpoints, which is always safe)."""

    try:
        data = store.get_bytes(record_key(checkpoint_prefix, sandbox_id, generation))
        return DrainRecord.model_validate_json(data)
    except ObjectNotFound:
        return None
    except (StorageError, ValueError) as exc:
        log.warning("drain record of %s g%d unusable, ignored: %s", sandbox_id, generation, exc)
        return None


def drain_host(host: SandboxHost, deadline_s: float, *, concurrency: int = 2,
               progress: Callable[[DrainReport], None] = lambda _r: None) -> DrainReport:  # fmt: skip
    """Move every sandbox off `host` within `deadline_s`; the host refuses new ones from now on.

    The deadline bounds the wait for each sandbox's safe point; a checkpoint begun before
    it is finished (about a second). Returns once no sandbox is left, then waits (within
    the deadline) until each moved sandbox's trajectory has been told, so its next call
    is answered at once rather than timing out against a worker that is gone.
    """
    started = time.monotonic()
    deadline = started + deadline_s
    host.draining = True
    report = DrainReport(host_queue=host.host_queue, deadline_s=deadline_s)
    guard = threading.Lock()

    def one(sandbox_id: str) -> None:
        outcome = host.move_out(sandbox_id, deadline)
        with guard:
            report.sandboxes.append(outcome)
            progress(report)

    seen: set[str] = set()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        # Again until none is new: a restore that began before the drain may land meanwhile.
        while todo := sorted(set(host.backend.lineages()) - seen):
            seen.update(todo)
            list(pool.map(one, todo))
    report.emptied_s = time.monotonic() - started
    moved = {s.sandbox_id for s in report.sandboxes if s.outcome == "moved"}
    while time.monotonic() < deadline and not moved <= host.told_moved():
        time.sleep(0.2)
    report.answered = len(moved & host.told_moved())
    report.sandboxes.sort(key=lambda s: s.sandbox_id)
    progress(report)
    return report
