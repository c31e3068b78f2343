"""What a trajectory did, when: activity intervals read back from its Temporal history.

Only reads; works for closed runs. Every interval is (kind, start, end, outcome) in epoch
seconds, where start is when a worker picked the activity up (or when it was scheduled,
if no start was recorded) and outcome is completed, failed, timed_out or canceled.
"""

from __future__ import annotations

from pydantic import BaseModel
from temporalio.api.enums.v1 import EventType

from belayer.temporal_client import connect

KINDS = {
    "generate": "generate",
    "sandbox.exec": "action",
    "sandbox.checkpoint": "checkpoint",
    "sandbox.capture_checkpoint": "checkpoint",
    "sandbox.publish_checkpoint": "checkpoint",
    "sandbox.recover": "recover",
    "sandbox.create": "setup",
    "start_context": "context",
    "append_observation": "context",
    "sandbox.workspace_hash": "finish",
    "sandbox.destroy": "finish",
}


class Interval(BaseModel):
    kind: str
    name: str
    scheduled: float
    start: float
    end: float
    outcome: str
    attempt: int = 1


class History(BaseModel):
    id: str
    start: float | None = None
    end: float | None = None
    intervals: list[Interval] = []
    error: str | None = None


async def fetch_histories(config, ids: list[str]) -> dict[str, History]:
    """Histories of `ids`; one that cannot be read says why instead of failing the report."""

    client = await connect(config.temporal, config.storage.encryption_key)
    found = {}
    for workflow_id in ids:
        try:
            found[workflow_id] = await _history(client.get_workflow_handle(workflow_id))
        except Exception as exc:  # a missing or unreachable history is reported, the rest still plotted
            found[workflow_id] = History(id=workflow_id, error=f"{type(exc).__name__}: {exc}"[:300])
    return found


async def _history(handle) -> History:
    history = History(id=handle.id)
    scheduled: dict[int, tuple[str, float]] = {}
    started: dict[int, tuple[float, int]] = {}
    closing = {
        EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: (
            "completed",
            "activity_task_completed_event_attributes",
        ),
        EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED: ("failed", "activity_task_failed_event_attributes"),
        EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT: (
            "timed_out",
            "activity_task_timed_out_event_attributes",
        ),
        EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED: ("canceled", "activity_task_canceled_event_attributes"),
    }
    async for event in handle.fetch_history_events():
        at = event.event_time.ToDatetime().timestamp() if event.HasField("event_time") else 0.0
        if history.start is None:
            history.start = at
        history.end = at
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            scheduled[event.event_id] = (attrs.activity_type.name, at)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            attrs = event.activity_task_started_event_attributes
            started[attrs.scheduled_event_id] = (at, attrs.attempt or 1)
        elif event.event_type in closing:
            outcome, field = closing[event.event_type]
            scheduled_id = getattr(event, field).scheduled_event_id
            name, scheduled_at = scheduled.get(scheduled_id, ("?", at))
            start, attempt = started.get(scheduled_id, (scheduled_at, 1))
            history.intervals.append(
                Interval(
                    kind=KINDS.get(name, "other"),
                    name=name,
                    scheduled=scheduled_at,
                    start=start,
                    end=at,
                    outcome=outcome,
                    attempt=attempt,
                )
            )
    return history
