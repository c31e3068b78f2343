"""Lineage records: which host and container hold each generation of a sandbox lineage.

A host that creates or restores generation N of a lineage writes
`<checkpoint_prefix><sandbox id>/lineage/g<N>.json` *before* its container starts, so
from the moment a recovery begins elsewhere, the lineage has moved on for everyone who
reads the store. The host of an older generation reads it to fence its own container
(belayer/sandbox/host.py: at worker start, and before each action or checkpoint).

Why one object per generation: the store has create-if-absent but no compare-and-swap,
so a single overwritten record would let a late, older writer (a host coming back)
replace a newer one. Per-generation keys make that impossible -- an older writer can
only write its own, lower generation -- and a reader takes the highest generation
listed. Within one generation the last writer wins (a plain put, not if-absent): a
create or recover retried on another host after the first host died must take the
lineage over, and the workflow only ever holds the handle of the attempt that returned.

Records outlive `delete_checkpoints` (the host keeps `lineage/`): a host that comes
back after its trajectory ended must still learn that its container is stale. They
are ~200 bytes per generation; an object-store lifecycle rule may expire them once
no host can be away that long.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from belayer.sandbox.models import SandboxId

log = logging.getLogger(__name__)

DIR = "lineage/"


class LineageStore(Protocol):
    """The slice of belayer.storage.ObjectStore that lineage records use."""

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False): ...
    def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes: ...
    def list(self, prefix: str = ""): ...


class LineageRecord(BaseModel):
    """Who holds one generation of a lineage."""

    model_config = ConfigDict(extra="forbid")

    sandbox_id: SandboxId
    generation: int = Field(ge=0, description="The generation this record describes.")
    host_queue: str = Field(description="Task queue of the host that created or restored it.")
    container: str = Field(description="Container name on that host.")
    written_at: float = Field(description="Unix time of the write (for people reading the store).")


def lineage_prefix(checkpoint_prefix: str, sandbox_id: str) -> str:
    return f"{checkpoint_prefix}{sandbox_id}/{DIR}"


def record_key(checkpoint_prefix: str, sandbox_id: str, generation: int) -> str:
    # Zero-padded so a listing reads in generation order; readers still parse and compare.
    return f"{lineage_prefix(checkpoint_prefix, sandbox_id)}g{generation:010d}.json"


def write(store: LineageStore, checkpoint_prefix: str, sandbox_id: str, generation: int, host_queue: str,
          container: str) -> LineageRecord:  # fmt: skip
    rec = LineageRecord(sandbox_id=sandbox_id, generation=generation, host_queue=host_queue, container=container,
                        written_at=time.time())  # fmt: skip
    store.put_bytes(record_key(checkpoint_prefix, sandbox_id, generation), rec.model_dump_json().encode())
    return rec


def newest_generation(store: LineageStore, checkpoint_prefix: str, sandbox_id: str) -> int | None:
    """The highest generation recorded for the lineage (one LIST request); None if none is."""
    prefix = lineage_prefix(checkpoint_prefix, sandbox_id)
    newest = None
    for key in store.list(prefix):
        name = key[len(prefix) :]
        if name.startswith("g") and name.endswith(".json") and name[1:-5].isdigit():
            newest = max(newest or 0, int(name[1:-5]))
    return newest


def newest(store: LineageStore, checkpoint_prefix: str, sandbox_id: str) -> LineageRecord | None:
    """The record of the highest generation (a LIST and a GET); None if none is."""
    generation = newest_generation(store, checkpoint_prefix, sandbox_id)
    if generation is None:
        return None
    data = store.get_bytes(record_key(checkpoint_prefix, sandbox_id, generation))
    return LineageRecord.model_validate_json(data)
