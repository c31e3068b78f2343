"""One rollout node per node id: a second node with an id in use is refused before it
touches anything.

A node's id names its shared-memory segments (`/dev/shm/belayer-<id>-*`) and its task
queue (`belayer-rollout-<id>`). A second node with the same id on the same machine would
take the first one's segments for a crashed predecessor's and unlink them at start; one on
another machine would take turns meant for the first one's prefix cache, and its weight
publishes. So a node claims its id first:

* on its machine, with an exclusive `flock` on `/run/lock/belayer-rollout-<id>.lock`,
  held for the life of the process. The kernel releases it when the process dies, so a
  restart after a crash is never refused;
* across machines, by asking Temporal who polls the node's queue (the node's worker asks,
  belayer/workers/rollout/worker.py; `other_host_pollers` judges the answer): a Belayer
  rollout node on another host that polled within `LIVE_POLLER_S` is alive (a live worker
  polls again as soon as its long poll of at most a minute ends). A node of the same host
  name is this node's own predecessor (a restarted process or pod), whose lock the kernel
  has released.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO

from belayer.rollout import shm
from belayer.rollout.errors import RolloutError

LOCK_DIR = Path("/run/lock")
LIVE_POLLER_S = 70.0
_IDENTITY_PREFIX = "belayer-rollout-"


class DuplicateNodeIdError(RolloutError):
    """Another live rollout node has this node's id."""

    retryable = False


def lock_path(node_id: str) -> Path:
    directory = LOCK_DIR if os.access(LOCK_DIR, os.W_OK) else Path(tempfile.gettempdir())
    return directory / f"belayer-rollout-{node_id}.lock"


def claim_on_this_machine(node_id: str) -> IO:
    """The open, locked file that reserves `node_id` on this machine; keep it open for
    as long as the node runs. Raises `DuplicateNodeIdError` naming the holder."""
    path = lock_path(node_id)
    lock = path.open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise DuplicateNodeIdError(
            f"rollout node id {node_id!r} is in use on this machine by {holder} (lock {path}); "
            "give this node its own BELAYER_ROLLOUT__NODE_ID (rollout.node_id), or stop that node first"
        ) from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}\n")
    lock.flush()
    return lock


def other_host_pollers(identities_seen: list[tuple[str, float]], host: str) -> list[str]:
    """The rollout-node identities (`belayer-rollout-<id>@<host>:<pid>`) that are on
    another host and polled within `LIVE_POLLER_S`, from (identity, seconds since seen)."""
    live = []
    for identity, age_s in identities_seen:
        if not identity.startswith(_IDENTITY_PREFIX) or age_s > LIVE_POLLER_S:
            continue
        their_host = identity.rpartition("@")[2].rpartition(":")[0]
        if their_host != host:
            live.append(identity)
    return live


def cleanup_node(node_id: str) -> list[str]:
    """What `belayer down` calls after stopping the node worker: remove the node's shared
    memory if the worker could not (SIGKILLed). Its children die with it (PDEATHSIG).

    Only while no live node holds the id on this machine: another stack's node with the
    same id (a test stack beside a developer's) owns those segments, and unlinking them
    breaks it at its next takeover."""
    try:
        with claim_on_this_machine(node_id):
            return [str(p) for p in shm.unlink_segments(node_id)]
    except DuplicateNodeIdError:
        return []
