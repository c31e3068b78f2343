"""The rollout node worker process: a `RolloutNode` serving `generate` over Temporal.

It listens on the node's own task queue (turn affinity: the next turn of a trajectory
comes back here and reuses the prefix cache) and on the shared rollout queue (any node
may take a turn whose node is gone). `rollout.publish_weights` and
`rollout.weights_version` are served on the node's own queue only: a trainer publishes
to each node by name. A restarted worker publishes the version it last served into its
new engines before it polls (`PublishActivities.restore`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from belayer.activities.generate import RolloutActivities
from belayer.activities.publish import PublishActivities
from belayer.config import BelayerConfig
from belayer.model.build import model_path
from belayer.rollout.identity import (
    LIVE_POLLER_S,
    DuplicateNodeIdError,
    claim_on_this_machine,
    other_host_pollers,
)
from belayer.rollout.node import RolloutNode
from belayer.rollout.status import NodeStatus
from belayer.storage.store import open_store
from belayer.temporal_client import pollers
from belayer.workers.rollout.slots import room_tuner
from belayer.workers.runner import RefusedToServe, run_worker

log = logging.getLogger("belayer.rollout")


def node_task_queue(config: BelayerConfig) -> str:
    return f"{config.temporal.rollout_task_queue}-{config.rollout.node_id}"


def banner(config: BelayerConfig) -> str:
    return (
        f"belayer rollout node {config.rollout.node_id}: serving {node_task_queue(config)} "
        f"and {config.temporal.rollout_task_queue}"
    )


@contextmanager
def node_id_claimed(config: BelayerConfig) -> Iterator[None]:
    """Hold the node's id on this machine for as long as the process serves. A node whose
    id a live node has, here or (`refuse_a_live_twin`, once serving starts) on another
    host, is refused with exit status 1."""
    try:
        with claim_on_this_machine(config.rollout.node_id):
            yield
    except DuplicateNodeIdError as exc:
        raise RefusedToServe(f"error: {exc}") from None


async def refuse_a_live_twin(config: BelayerConfig, own_queue: str) -> None:
    """Raise `DuplicateNodeIdError` when a node on another host serves `own_queue` now
    (the check across machines of belayer/rollout/identity.py: Temporal lists the pollers)."""
    seen = await pollers(config.temporal, own_queue, "activity", config.storage.encryption_key)
    twins = other_host_pollers(seen, socket.gethostname())
    if twins:
        raise DuplicateNodeIdError(
            f"rollout node id {config.rollout.node_id!r} is served by a live node on another host "
            f"({', '.join(twins)}, polling {own_queue}); give this node its own BELAYER_ROLLOUT__NODE_ID "
            f"(rollout.node_id), or stop that node and start this one {LIVE_POLLER_S:.0f} s later"
        )


# Activity slots of the node's own queue beyond its sequences. A turn that arrives while the
# node is full is taken and refused at once (`NodeFull`), and the trajectory sends it to the
# shared queue, where a node with room serves it; with no more slots than sequences it
# would wait in this queue, unseen by the other nodes, until its affinity timeout. Publishes
# and appends, which take no sequence, are never held behind turns either.
REFUSAL_SLOTS = 8


def own_queue_slots(max_num_seqs: int) -> int:
    return max_num_seqs + REFUSAL_SLOTS


async def serve(config: BelayerConfig) -> None:
    own_queue = node_task_queue(config)
    await refuse_a_live_twin(config, own_queue)  # before the node takes its id's segments
    model_dir = model_path(config.rollout.model, config.cache_dir)
    node = RolloutNode(config.rollout, model_dir)
    node.start(wait_shadow=False)  # serve as soon as the leader is up; the shadow follows
    node.add_state_listener(functools.partial(publish_roles, roles_file(config)))
    try:
        store = open_store(config.storage, encrypted=False)
        # a turn's generate appends the observation before it: read through the encryption at
        # rest of observations and log records, when configured
        activities = RolloutActivities(node, open_store(config.storage), own_queue)
        publishing = PublishActivities(node, store, remember=published_file(config))
        node.weight_source = publishing.tensors_of  # a version a new owner could not adopt
        try:
            restored = publishing.restore()
        except Exception as exc:  # serve the built model; a trainer's version check catches the rest
            log.warning("could not restore the weights published before this worker restarted: %s", exc)
        else:
            if restored is not None:
                log.info(
                    "restored weights version %d (published before this worker restarted)", restored.version
                )
        await run_worker(
            config.temporal,
            encryption_key=config.storage.encryption_key,
            role=f"rollout-{config.rollout.node_id}",
            task_queues=[own_queue, config.temporal.rollout_task_queue],
            activities=[activities.generate],
            # the last observation of a run is appended where its log's head is known
            queue_activities={own_queue: [*publishing.all(), activities.context.append_observation]},
            max_concurrent_activities=own_queue_slots(config.rollout.max_num_seqs),
            tuners={
                config.temporal.rollout_task_queue: room_tuner(node.has_room, config.rollout.max_num_seqs)
            },
        )
    finally:
        node.close()
        roles_file(config).unlink(missing_ok=True)


def published_file(config: BelayerConfig) -> Path:
    """The weights version last published into this node (`PublishActivities.restore`)."""
    return config.state_dir / "run" / f"rollout-{config.rollout.node_id}.published.json"


def roles_file(config: BelayerConfig) -> Path:
    """Where the node says which pid is owner, leader and shadow right now (for `belayer chaos`)."""
    return config.state_dir / "run" / f"rollout-{config.rollout.node_id}.roles.json"


def read_roles(config: BelayerConfig) -> NodeStatus | None:
    """The node's roles as its worker last wrote them (`RolloutNode.roles()`); None when there
    is no node to ask (or no file it could have written), so a before/after comparison finds
    nothing."""
    try:
        return NodeStatus.from_json(json.loads(roles_file(config).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def recoveries_of(state: NodeStatus | None) -> int:
    """How many recoveries the node had made when it wrote `state` (0: no node)."""
    return state.recoveries if state is not None else 0


def generation_of(state: NodeStatus | None) -> int:
    """The node's owner generation when it wrote `state` (0: no node)."""
    return state.generation if state is not None else 0


def publish_roles(path: Path, state: NodeStatus) -> None:
    """Write `RolloutNode.roles()` atomically (a reader never sees half a file), as the JSON
    of `NodeStatus.to_json`. Called by the node on its pump thread whenever a role, the epoch
    or the recovery count changes, so fault injection always hits the process that holds a
    role now."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_json(), sort_keys=True))
    os.replace(tmp, path)


def describe_roles(state: NodeStatus | None) -> str:
    """One line for `belayer status`: who leads, whether a takeover is possible, the last
    recovery; `state` is what the node last published (`RolloutNode.roles()`)."""
    if state is None:
        return "no roles published yet"
    if state.broken:
        return f"BROKEN: {state.broken}"
    parts = [
        f"leader pid {state.leader}",
        f"shadow {state.shadow_state}",
        f"owner {state.owner_state}",
        f"weights v{state.weights_version}",
    ]
    if state.capacity is not None:
        load = state.capacity
        parts.append(
            f"{load.in_flight}/{load.sequences} sequences ({load.kv_tokens} KV tokens)"
            + (f", {load.refused} refused at capacity" if load.refused else "")
        )
    if state.hang_deadline.current_s is not None:
        parts.append(f"hang deadline {state.hang_deadline.current_s:.1f} s")
    last = state.last_recovery
    if last:
        parts.append(f"last recovery {last.kind} in {last.ready_s:.2f} s")
    owner = state.last_owner_recovery
    if owner:
        parts.append(f"protected again {owner.protected_again_s:.1f} s after the owner died")
    line = "; ".join(parts)
    return f"DEGRADED: {state.degraded}; {line}" if state.degraded else line
