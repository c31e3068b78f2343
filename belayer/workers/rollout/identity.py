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
* across machines, by asking Temporal who polls the node's queue: a Belayer rollout node
  on another host that polled within `LIVE_POLLER_S` is alive (a live worker polls again
  as soon as its long poll of at most a minute ends). A node of the same host name is this
  node's own predecessor (a restarted process or pod), whose lock the kernel has released.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path
from typing import IO

from belayer.config import BelayerConfig
from belayer.workers.rollout.errors import RolloutError

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


async def refuse_a_live_twin(config: BelayerConfig, own_queue: str) -> None:
    """Raise `DuplicateNodeIdError` when a node on another host serves `own_queue` now."""
    from belayer.stack.workers import pollers

    seen = await pollers(config.temporal, own_queue, "activity", config.storage.encryption_key)
    twins = other_host_pollers(seen, socket.gethostname())
    if twins:
        raise DuplicateNodeIdError(
            f"rollout node id {config.rollout.node_id!r} is served by a live node on another host "
            f"({', '.join(twins)}, polling {own_queue}); give this node its own BELAYER_ROLLOUT__NODE_ID "
            f"(rollout.node_id), or stop that node and start this one {LIVE_POLLER_S:.0f} s later"
        )
