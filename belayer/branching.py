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

    parent, result, sandbox_id, stage_checks = await _parent(client, parent_id)
    if result.log is None:
        raise BelayerError(
            f"{parent_id} ended before its first step ({result.reason}): nothing to branch from"
        )
    store = open_store(config.storage)
    steps = read_steps(store, result.log.steps)
    if not 1 <= at_step <= len(steps):
        raise BelayerError(f"{parent_id} has steps 1..{len(steps)}; --at-step {at_step} is not one of them")
    at = steps[at_step - 1]
    # Within a multi-step task's later stage, nothing before its boundary can be replayed
    # (the tests and the next stage's files ran in no action): only checkpoints from there.
    stage_start = min(step.step for step in steps if step.stage == at.stage) if at.stage else 0
    checkpoints = []
    if sandbox_id is not None:  # `store` decrypts what the sandbox hosts encrypted, when a key is set
        checkpoints = checkpoints_at_or_before(store, config.sandbox.checkpoint_prefix, sandbox_id, at_step)
    if parent.start_from is not None:  # the parent's own origin: its group's setup, or its parent's
        checkpoints += [c for c in parent.start_from.checkpoints if c.step <= at_step]
    checkpoints = [c for c in checkpoints if c.step >= stage_start]
    if at.stage and not checkpoints:
        raise BelayerError(
            f"step {at_step} of {parent_id} is in its task's step {at.stage + 1}, which began at step "
            f"{stage_start}, and no checkpoint of it from there was kept: a branch cannot replay across "
            "a step's tests. Run the parent with --keep-checkpoints to branch there."
        )
    start = ForkStart(
        parent=parent_id, at_step=at, steps=result.log.steps, checkpoints=checkpoints,
        stage_checks=stage_checks[: at.stage], stage_start=stage_start,
    )  # fmt: skip
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
    """The parent's input, result, sandbox lineage id, and the checks of the stages it
    passed (a multi-step task's boundaries, in order), from its history."""

    handle = client.get_workflow_handle(parent_id)
    converter = client.data_converter
    parent = result = sandbox_id = None
    boundaries, passed = set(), []  # the VERIFY events that begin a next stage; their results
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
                elif attrs.activity_type.name == sandbox.VERIFY.name:
                    verify = (await converter.decode(attrs.input.payloads, [sandbox.VERIFY.args]))[0]
                    if verify.next_stage is not None:
                        boundaries.add(event.event_id)
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                attrs = event.activity_task_completed_event_attributes
                if attrs.scheduled_event_id in boundaries:
                    checked = (await converter.decode(attrs.result.payloads, [sandbox.VERIFY.result]))[0]
                    if checked.next_observation is not None:
                        passed.append(checked)
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
    # The stages passed before this run of the history: carried over a continue-as-new, or
    # inherited from the trajectory the parent itself branched from.
    if parent.carried is not None:
        earlier = parent.carried.stage_checks
    else:
        earlier = parent.start_from.stage_checks if parent.start_from is not None else []
    if parent.carried is not None and parent.carried.sandbox is not None:
        sandbox_id = sandbox_id or parent.carried.sandbox.sandbox_id
    return parent.model_copy(update={"carried": None}), result, sandbox_id, [*earlier, *passed]
