"""Branches of a finished trajectory: new trajectories that continue it after its step K.

`branch_inputs` reads what the parent left -- its input and result (the Temporal
history), its step log (the object store), the checkpoints its sandbox lineage kept
(`belayer run --keep-checkpoints` / `TrajectoryInput.keep_checkpoints`), then those it
started from itself (its group's set-up sandbox, the checkpoints of the trajectory it
branched from) -- and returns
`TrajectoryInput`s whose `start_from` (a `ForkStart`) names the parent's step K: each
branch restores the latest usable checkpoint at or before K as a sandbox of its own,
replay-verifies up to K, and continues from the context the parent had after step K.
Without kept checkpoints a branch replays steps 1..K in a fresh sandbox: slower, same
result. Tree search and resampling from a prefix start these with any Temporal client;
`belayer fork` is this plus following them.
"""

from __future__ import annotations

import uuid

from temporalio.api.enums.v1 import EventType
from temporalio.service import RPCError

from belayer.contracts import sandbox
from belayer.errors import BelayerError
from belayer.sandbox.checkpoints import checkpoints_at_or_before
from belayer.storage.store import open_store
from belayer.trajectory_log import read_steps
from belayer.workflows.models import ForkStart, TrajectoryInput, TrajectoryResult


async def branch_inputs(client, config, parent_id: str, at_step: int, count: int, *,
                        seed: int | None = None, temperature: float | None = None) -> list:  # fmt: skip
    """`count` inputs branching `parent_id` after step `at_step`. Branch i samples with
    seed `seed + i` (default: the parent's seed + 1 + i; the parent's own seed replays its
    later steps) and the parent's temperature unless `temperature` is given."""

    parent, result, sandbox_id = await _parent(client, parent_id)
    if result.log is None:
        raise BelayerError(
            f"{parent_id} ended before its first step ({result.reason}): nothing to branch from"
        )
    store = open_store(config.storage)
    steps = read_steps(store, result.log.steps)
    if not 1 <= at_step <= len(steps):
        raise BelayerError(f"{parent_id} has steps 1..{len(steps)}; --at-step {at_step} is not one of them")
    checkpoints = []
    if sandbox_id is not None:  # `store` decrypts what the sandbox hosts encrypted, when a key is set
        checkpoints = checkpoints_at_or_before(store, config.sandbox.checkpoint_prefix, sandbox_id, at_step)
    if parent.start_from is not None:  # the parent's own origin: its group's setup, or its parent's
        checkpoints += [c for c in parent.start_from.checkpoints if c.step <= at_step]
    start = ForkStart(
        parent=parent_id, at_step=steps[at_step - 1], steps=result.log.steps, checkpoints=checkpoints
    )
    first_seed = parent.sampling.seed + 1 if seed is None else seed
    token = uuid.uuid4().hex[:4]
    return [parent.model_copy(update={
        "trajectory_id": f"{parent_id[:150]}-k{at_step}-b{i}-{token}",
        "sampling": parent.sampling.model_copy(update={
            "seed": first_seed + i,
            **({"temperature": temperature} if temperature is not None else {}),
        }),
        "start_from": start, "carried": None,
    }) for i in range(count)]  # fmt: skip


async def _parent(client, parent_id: str):
    """The parent's input, result, and sandbox lineage id, from its history."""

    handle = client.get_workflow_handle(parent_id)
    converter = client.data_converter
    parent = result = sandbox_id = None
    try:
        async for event in handle.fetch_history_events():
            kind = event.event_type
            if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
                payloads = event.workflow_execution_started_event_attributes.input.payloads
                parent = (await converter.decode(payloads, [TrajectoryInput]))[0]
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                attrs = event.activity_task_scheduled_event_attributes
                if attrs.activity_type.name == sandbox.DESTROY.name:
                    destroyed = (await converter.decode(attrs.input.payloads, [sandbox.DESTROY.args]))[0]
                    sandbox_id = destroyed.handle.sandbox_id
            elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
                payloads = event.workflow_execution_completed_event_attributes.result.payloads
                result = (await converter.decode(payloads, [TrajectoryResult]))[0]
    except RPCError as exc:
        raise BelayerError(
            f"no trajectory {parent_id!r} ({exc}); list them in the web UI or with `temporal workflow list`"
        ) from None
    if parent is None or result is None:
        raise BelayerError(
            f"{parent_id} has not ended (or is not a TrajectoryWorkflow): branch it once it has"
        )
    if parent.carried is not None and parent.carried.sandbox is not None:
        sandbox_id = sandbox_id or parent.carried.sandbox.sandbox_id
    return parent.model_copy(update={"carried": None}), result, sandbox_id
