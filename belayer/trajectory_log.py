"""A trajectory's log in the object store: steps, decisions and recoveries.

The workflow's state must stay bounded however long a trajectory runs (continue-as-new
carries it, Temporal caps payloads at 2 MB and histories at 50 MB), so what grows with
every turn lives here, written by activities, append-only:

- steps: `trajectories/<id>/steps/v<g>` — a record log (`belayer.storage.recordlog`)
  per context branch `g`; a context cut forks the next branch from the steps it keeps,
  so the log always reads as the steps the current context saw;
- decisions: `trajectories/<id>/decisions` — every checkpoint decision, in order, each
  written once it is complete (what the generation and the checkpoint really took);
- recoveries: `trajectories/<id>/recoveries` — every sandbox recovery, in order.

The workflow keeps a `TrajectoryLogRef` (keys and counts) and the few recent entries the
checkpoint policy needs. Records are encrypted at rest when archives are.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer.policy.adaptive import DecisionRecord
from belayer.sandbox.models import ObservationRef
from belayer.storage.recordlog import RecordLog, RecordLogRef
from belayer.storage.tokenlog import PrefixRef


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepRecord(_Model):
    """One executed step, as the context saw it."""

    step: int = Field(ge=1)
    command: str
    observation: ObservationRef = Field(description="Where the step's observation is stored, and its hash.")
    context_after_action: PrefixRef = Field(description="Context up to and including this action.")
    stage: int = Field(
        0,
        ge=0,
        description="A multi-step task's stage (Harbor's [[steps]] entry, 0 first) the step belongs to; "
        "a later stage's first step is its boundary (its tests, then the next stage's files).",
    )


class RecoveryRecord(_Model):
    """One recovery: what failed, how it came back, what it cost."""

    kind: Literal["sandbox", "fork"] = Field(
        description="'sandbox': a lost sandbox restored; 'fork': a branch's sandbox started from its parent's "
        "checkpoint (or by replay) before its first turn."
    )
    step: int = Field(description="Step whose action was in flight when the failure surfaced.")
    reason: str
    source: str = Field(description="Checkpoint step restored, replay from the start, or 'failed'.")
    failed: bool = Field(
        False,
        description="The recover itself failed (its new sandbox was lost too, or "
        "nothing could be restored); `notes` says why.",
    )
    replayed_steps: int
    consistent: bool
    notes: list[str] = Field([], description="Checkpoints skipped as unusable and fallbacks taken, and why.")
    cut_after_step: int | None = Field(None, description="Context cut after this action (mismatch).")
    tokens_discarded: int = 0
    time_lost_s: float


class TrajectoryLogRef(_Model):
    """Where a trajectory's log is and how much of it there is."""

    trajectory_id: str
    steps: RecordLogRef = Field(description="The current branch's step log.")
    decisions: int = Field(0, ge=0, description="Decision records written.")
    recoveries: int = Field(0, ge=0, description="Recovery records written.")


class LogEntries(_Model):
    """Records for the log, appended by an activity the workflow runs anyway."""

    decisions_from: int = Field(1, ge=1, description="Position of the first decision below.")
    decisions: list[DecisionRecord] = []
    recoveries_from: int = Field(1, ge=1, description="Position of the first recovery below.")
    recoveries: list[RecoveryRecord] = []


def steps_key(trajectory_id: str, branch: int) -> str:
    return f"trajectories/{trajectory_id}/steps/v{branch}"


def decisions_key(trajectory_id: str) -> str:
    return f"trajectories/{trajectory_id}/decisions"


def recoveries_key(trajectory_id: str) -> str:
    return f"trajectories/{trajectory_id}/recoveries"


def start_log(store: Any, trajectory_id: str, steps: str, *, steps_from: RecordLogRef | None = None) -> None:
    """A trajectory's log: its first step-log branch (empty, or inheriting `steps_from`'s
    steps: a branch of another trajectory), its decisions and recoveries. Created once, so
    the writes of every later step need no manifest."""
    start_steps(store, steps, fork_from=steps_from)
    for key in (decisions_key(trajectory_id), recoveries_key(trajectory_id)):
        RecordLog.create(store, key)


def start_steps(store: Any, key: str, *, fork_from: RecordLogRef | None = None) -> None:
    """A new branch of the step log: empty, or inheriting `fork_from`'s steps (a context cut)."""
    if fork_from is None:
        RecordLog.create(store, key)
    else:
        RecordLog.fork(store, fork_from, key)


def write_step(store: Any, key: str, record: StepRecord) -> None:
    RecordLog(store, key).put(record.step, record.model_dump(mode="json"))


def write_entries(store: Any, trajectory_id: str, entries: LogEntries) -> None:
    for key, first, records in (
        (decisions_key(trajectory_id), entries.decisions_from, entries.decisions),
        (recoveries_key(trajectory_id), entries.recoveries_from, entries.recoveries),
    ):
        if records:
            log = RecordLog(store, key)
            for offset, record in enumerate(records):
                log.put(first + offset, record.model_dump(mode="json"))


def read_steps(store: Any, log: RecordLogRef) -> list[StepRecord]:
    return [StepRecord.model_validate(r) for r in RecordLog(store, log.key).read(log.length)]


def read_decisions(store: Any, log: TrajectoryLogRef) -> list[DecisionRecord]:
    records = RecordLog(store, decisions_key(log.trajectory_id)).read(log.decisions)
    return [DecisionRecord.model_validate(r) for r in records]


def read_recoveries(store: Any, log: TrajectoryLogRef) -> list[RecoveryRecord]:
    records = RecordLog(store, recoveries_key(log.trajectory_id)).read(log.recoveries)
    return [RecoveryRecord.model_validate(r) for r in records]
