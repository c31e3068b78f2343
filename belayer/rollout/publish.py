"""Publishing a new weights version into a running node, in place.

1. stage: the owner creates an empty segment for the version (loop thread, one message);
2. write: the publisher's thread copies the trainer's tensors into it (vLLM layout, the
   engines' dtype) and hashes what it meant to write; no disk round trip;
3. seal: the owner re-hashes the segment; only if every tensor matches does it mark the
   segment OK, and the node makes it the version the engines move to. A torn or corrupt
   write is refused and its segment unlinked: nothing is ever served from it. A publish
   that fails before that (a write that raises, an owner reply that does not come in
   time) unstages its segment, so the version can be published again at once; a late
   reply is matched to its request by (request id, version) and dropped;
4. switch (loop thread, at step boundaries): each engine gets SwitchWeights once nothing
   of the old version is scheduled on it. In-flight requests follow the policy:
   - `continue_on_new`: they are aborted on the leader, which switches at once, then sent
     again (prompt + tokens so far): the KV is rebuilt by re-prefill on the new weights;
   - `finish_on_old`: they finish on the old version; new requests wait until the last
     old one is done, then both engines switch. A takeover meanwhile may use a shadow
     still on the old version, and a shadow started meanwhile starts on it, so the drain
     goes on after any number of failures.
   Either way every token carries the version of the step that produced it.
5. release: once both engines are on the new version, versions older than the previous
   one are dropped; the previous one stays until `release_weights`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from belayer.rollout import shm
from belayer.rollout.errors import BadRequestError, RolloutError
from belayer.rollout.owner import vllm_parts

Policy = Literal["finish_on_old", "continue_on_new"]
POLICIES = ("finish_on_old", "continue_on_new")


class PublishRefusedError(RolloutError):
    """The owner refused the new version (torn or corrupt write): nothing was served from it."""


@dataclass(frozen=True)
class PublishReport:
    version: int
    previous_version: int
    policy: str
    staged_s: float  # seconds from the call: segment created
    written_s: float  # tensors copied into it
    sealed_s: float  # checksums verified, version flipped in the owner
    switched_s: float  # both engines compute with it
    paused_requests: int  # continue_on_new: requests re-prefilled on the new version
    drained_requests: int  # finish_on_old: requests that finished on the old version


@dataclass
class Publish:
    """A publish in progress, advanced by the node's loop."""

    version: int
    previous_version: int
    policy: str
    started: float
    done: Future = field(default_factory=Future)
    marks: dict[str, float] = field(default_factory=dict)
    paused_requests: int = 0
    drained_requests: int = 0

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.perf_counter() - self.started

    def report(self) -> PublishReport:
        return PublishReport(
            version=self.version,
            previous_version=self.previous_version,
            policy=self.policy,
            staged_s=self.marks.get("staged", 0.0),
            written_s=self.marks.get("written", 0.0),
            sealed_s=self.marks.get("sealed", 0.0),
            switched_s=self.marks.get("switched", 0.0),
            paused_requests=self.paused_requests,
            drained_requests=self.drained_requests,
        )


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise BadRequestError(f"unknown in-flight policy {policy!r}; use one of {', '.join(POLICIES)}")
    return policy


def write_staged(path, tensors: Mapping[str, object], dtype: str) -> dict[str, str]:
    """Copy the trainer's tensors into the staged segment; return the sha256 of each tensor
    as the publisher meant it (the owner compares against the segment's bytes).

    One copy per tensor, straight into the mapping (a fused vLLM parameter is written part
    after part), hashing the source's own buffers, two tensors at a time (torch's copy and
    hashlib release the GIL)."""
    import torch

    parts = vllm_parts(dict(tensors), dtype)
    mm = shm.map_readwrite(path)
    try:
        header, entries = shm.read_manifest(mm)
        _check_layout(entries, parts)

        def copy_and_hash(entry: shm.TensorEntry) -> str:
            digest, start = hashlib.sha256(), header.data_offset + entry.offset
            for part in parts[entry.name]:
                source = part.reshape(-1).view(torch.uint8)
                target = torch.frombuffer(mm, dtype=torch.uint8, count=source.numel(), offset=start)
                target.copy_(source)
                del target  # the mapping cannot close while a tensor exports it
                digest.update(source.numpy())
                start += source.numel()
            return digest.hexdigest()

        with ThreadPoolExecutor(max_workers=2) as pool:
            digests = list(pool.map(copy_and_hash, entries))
        return {entry.name: digest for entry, digest in zip(entries, digests, strict=True)}
    finally:
        mm.close()


def _check_layout(entries: list[shm.TensorEntry], parts: dict[str, list]) -> None:
    names = {e.name for e in entries}
    missing, unknown = names - set(parts), set(parts) - names
    if missing or unknown:
        raise BadRequestError(
            f"published tensors do not match the served model: missing {sorted(missing)[:3]}, "
            f"unknown {sorted(unknown)[:3]} (send the model's full state dict, HF or vLLM names)"
        )
    for entry in entries:
        shapes = [tuple(p.shape) for p in parts[entry.name]]
        rows = sum(shape[0] for shape in shapes)
        if any(shape[1:] != entry.shape[1:] for shape in shapes) or rows != entry.shape[0]:
            raise BadRequestError(f"{entry.name}: published shapes {shapes}, served {entry.shape}")
