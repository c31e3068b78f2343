"""A train step's samples by reference: stored in parts, each named by key and sha256.

Temporal refuses a payload over 2 MB: an iteration of 10,000 samples inline in
`TrainStepArgs` (about 650 bytes each: the trajectory id, its group, its token log's
`PrefixRef` and its `RolloutRef`) would be refused. The workflow stores them in parts of
`SAMPLES_PER_PART` (belayer/contracts/batches.py; an activity each, so no payload grows
with the batch), and the step carries only the parts' references. A part's key is its
iteration's folder and its own sha256: a retried write is the same object, and retention
deletes an iteration's parts with its checkpoint (`batch_prefix`).
"""

from __future__ import annotations

from pydantic import TypeAdapter

from belayer.storage.store import put_by_hash
from belayer.trainer.models import SamplesRef, TrainSample

SAMPLES = TypeAdapter(list[TrainSample])


def batch_prefix(run_id: str, iteration: int) -> str:
    return f"runs/{run_id}/batches/iteration-{iteration:06d}/"


def store_samples(store, run_id: str, iteration: int, samples: list[TrainSample]) -> SamplesRef:
    stored = put_by_hash(store, batch_prefix(run_id, iteration), SAMPLES.dump_json(samples), ".json")
    return SamplesRef(key=stored.key, sha256=stored.sha256, count=len(samples))


def load_samples(store, refs: list[SamplesRef]) -> list[TrainSample]:
    """Every sample of `refs`, in order; `CorruptObject` when a part does not verify."""
    return [sample for ref in refs for sample in SAMPLES.validate_json(store.get_bytes(ref.key,
                                                                                       expected_sha256=ref.sha256))]  # fmt: skip
