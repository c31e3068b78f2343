"""The memory owner: allocates and owns the node's weights and KV arena; never runs the model.

It loads the weights once into a POSIX shared-memory segment in the layout vLLM's Llama
expects (fused qkv and gate_up projections, engine dtype), records a sha256 per tensor,
creates the raw KV arena, then only answers checksum requests and re-verifies in the
background. Engines map both segments; the supervisor checks this process is alive and
the headers are intact before a takeover. No vLLM import here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from safetensors import safe_open

from belayer import faults
from belayer.model.build import MANIFEST, file_sha256
from belayer.rollout import shm
from belayer.rollout.procutil import die_with_parent
from belayer.rollout.protocol import (
    DropWeights,
    Failed,
    OwnerReady,
    OwnerSpec,
    Sealed,
    SealRefused,
    SealWeights,
    Staged,
    StageWeights,
    Stop,
    UnstageWeights,
    VerifyWeights,
    WeightsVerified,
)

ALIGN = 64


def owner_main(spec: OwnerSpec, conn: Connection) -> None:
    """Entry point of the owner process (multiprocessing spawn target)."""
    die_with_parent()
    try:
        owner = MemoryOwner(spec)
        ready = owner.load()
    except Exception as exc:  # reported to the supervisor, which falls back or fails loudly
        conn.send(Failed(f"memory owner failed to load: {type(exc).__name__}: {exc}"))
        return
    conn.send(ready)
    owner.serve(conn)


class MemoryOwner:
    """Holds one segment per weights version it keeps, plus the arena; seals published ones.
    Which version the engines use is the node's decision, never the owner's."""

    def __init__(self, spec: OwnerSpec):
        self.spec = spec
        self.arena_path = spec.adopt_arena or shm.arena_path(spec.node_id, spec.generation)
        self.segments: dict[int, WeightsSegment] = {}
        self.staged: dict[int, WeightsSegment] = {}

    def load(self) -> OwnerReady:
        """Adopt the predecessor's verified segments (or build version 1) and the arena. Which
        version is current is the node's to say (`spec.current_version`): the node outlives
        every owner, and a seal does not make a version current, the node's switch does."""
        t0 = time.perf_counter()
        current = self.spec.current_version
        rejected = []
        for version, path in sorted(self.spec.adopt_weights.items()):
            segment = WeightsSegment.adopt(path)
            if segment is not None:
                self.segments[version] = segment
            else:
                rejected.append(version)
        if current not in self.segments:
            # A published version that did not verify exists only with its publisher: hold the
            # built weights (and their layout) so that the node can stage it again from there.
            if 1 not in self.segments:
                self.segments[1] = self._load_from_disk()
            current = 1
        if self.spec.adopt_arena is None or not self._arena_intact():
            self.arena_path = shm.arena_path(self.spec.node_id, self.spec.generation)
            shm.create_arena(self.arena_path, self.spec.kv_bytes)
        entries = self.segments[current].entries
        return OwnerReady(
            pid=os.getpid(),
            versions={v: seg.path for v, seg in self.segments.items()},
            current_version=current,
            arena_path=self.arena_path,
            load_s=time.perf_counter() - t0,
            params=sum(math.prod(e.shape) for e in entries),
            weight_bytes=sum(e.nbytes for e in entries),
            rejected=tuple(rejected),
        )

    def _load_from_disk(self) -> WeightsSegment:
        check_model_files(self.spec.model_dir)
        tensors = vllm_layout(self.spec.model_dir, self.spec.dtype)
        path = shm.weights_path(self.spec.node_id, self.spec.generation, 1)
        segment = WeightsSegment.create(path, plan_entries(tensors), version=1)
        for entry, tensor in zip(segment.entries, tensors.values(), strict=True):
            segment.write(entry, tensor)
        segment.seal(segment.digests())
        return segment

    def _arena_intact(self) -> bool:
        try:
            header = shm.read_arena_header(self.spec.adopt_arena)
        except shm.SharedMemoryError:
            return False
        return header.data_size == self.spec.kv_bytes

    def serve(self, conn: Connection) -> None:
        selected = faults.switched_on()
        crash_at = None
        if "owner_crash" in selected and self.spec.generation == 1:  # a replacement owner never re-faults
            crash_at = time.monotonic() + selected["owner_crash"].number("after_s", 0.0)
        interval = self.spec.verify_interval_s
        next_verify = time.monotonic() + interval if interval > 0 else None
        while True:
            timeout = 0.5
            if crash_at is not None:
                timeout = max(0.0, min(timeout, crash_at - time.monotonic()))
            if conn.poll(timeout):
                try:
                    msg = conn.recv()
                except EOFError:  # supervisor gone
                    break
                if isinstance(msg, Stop):
                    break
                reply = self.handle(msg)
                if reply is not None:
                    conn.send(reply)
            now = time.monotonic()
            if crash_at is not None and now >= crash_at:
                faults.die_now()
            if next_verify is not None and now >= next_verify:
                result = self.verify()
                if not result.ok:
                    conn.send(result)  # unsolicited: the supervisor cold-starts on it
                next_verify = now + interval
        self.close()

    def handle(self, msg):
        if isinstance(msg, VerifyWeights):
            return self.verify()
        if isinstance(msg, StageWeights):
            return self.stage(msg)
        if isinstance(msg, SealWeights):
            return self.seal(msg)
        if isinstance(msg, UnstageWeights):
            self.unstage(msg.version)
        if isinstance(msg, DropWeights):
            self.drop(msg.versions)
        return None

    def stage(self, msg: StageWeights):
        version = msg.version
        if version in self.segments or version in self.staged:
            return SealRefused(
                version, f"weights version {version} already exists on this node", msg.request_id
            )
        layout = next(iter(self.segments.values())).entries  # every version has the model's layout
        entries = [shm.TensorEntry(**{**e.__dict__, "sha256": "0" * 64}) for e in layout]
        path = shm.weights_path(self.spec.node_id, self.spec.generation, version)
        path.unlink(missing_ok=True)  # a torn stage of an earlier attempt
        self.staged[version] = WeightsSegment.create(path, entries, version)
        return Staged(version, path, msg.request_id)

    def seal(self, msg: SealWeights):
        t0 = time.perf_counter()
        segment = self.staged.pop(msg.version, None)
        if segment is None:
            return SealRefused(
                msg.version, f"weights version {msg.version} was not staged on this owner", msg.request_id
            )
        problem = segment.mismatch(msg.sha256)
        if problem is not None:
            segment.discard()
            return SealRefused(
                msg.version, f"weights version {msg.version} refused: {problem}", msg.request_id
            )
        segment.seal(msg.sha256)
        self.segments[msg.version] = segment
        return Sealed(msg.version, time.perf_counter() - t0, msg.request_id)

    def unstage(self, version: int) -> None:
        segment = self.staged.pop(version, None) or self.segments.pop(version, None)
        if segment is not None:
            segment.discard()

    def drop(self, versions) -> None:
        """The node never asks to drop what an engine or a request uses."""
        for version in versions:
            if version in self.segments:
                self.segments.pop(version).discard()

    def verify(self) -> WeightsVerified:
        """Re-hash every sealed segment: each may be read by an engine (the served version, the
        one a finish-on-old drain is pinned to) or loaded by a takeover; a bad one is marked
        corrupt in its header, where the node's owner check reads it."""
        t0 = time.perf_counter()
        bad_tensors, bad_versions = [], []
        for version, segment in sorted(self.segments.items()):
            bad = segment.bad_tensors()
            shm.set_weights_status(segment.mm, shm.STATUS_CORRUPT if bad else shm.STATUS_OK)
            if bad:
                bad_versions.append(version)
                bad_tensors.extend(bad)
        return WeightsVerified(
            ok=not bad_versions,
            bad_tensors=tuple(bad_tensors),
            seconds=time.perf_counter() - t0,
            bad_versions=tuple(bad_versions),
        )

    def close(self) -> None:
        for segment in [*self.segments.values(), *self.staged.values()]:
            segment.discard()
        self.arena_path.unlink(missing_ok=True)


class WeightsSegment:
    """One version's weights in shared memory, with the manifest that checksums them."""

    def __init__(self, path: Path, mm):
        self.path, self.mm = path, mm
        header, self.entries = shm.read_manifest(mm)
        self.data_offset = header.data_offset

    @classmethod
    def create(cls, path: Path, entries: list[shm.TensorEntry], version: int) -> WeightsSegment:
        return cls(path, shm.create_weights_segment(path, entries, version))

    @classmethod
    def adopt(cls, path: Path) -> WeightsSegment | None:
        """A predecessor's segment, kept only if it is sealed and every tensor still verifies."""
        try:
            segment = cls(path, shm.map_readwrite(path))
        except (shm.SharedMemoryError, ValueError, OSError):
            return None
        header = shm.read_weights_header(segment.mm)
        if header.status != shm.STATUS_OK or segment.bad_tensors():
            segment.discard()
            return None
        return segment

    def write(self, entry: shm.TensorEntry, tensor) -> None:
        import torch  # import cost: torch, ~2.5 s; the node process imports this module too

        start = self.data_offset + entry.offset
        view = torch.frombuffer(self.mm, dtype=tensor.dtype, count=tensor.numel(), offset=start)
        view.copy_(tensor.reshape(-1))

    def digest(self, entry: shm.TensorEntry) -> str:
        start = self.data_offset + entry.offset
        with memoryview(self.mm) as mv:
            return hashlib.sha256(mv[start : start + entry.nbytes]).hexdigest()

    def digests(self) -> dict[str, str]:
        """Every tensor's sha256, two at a time (hashlib releases the GIL)."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            return dict(zip((e.name for e in self.entries), pool.map(self.digest, self.entries), strict=True))

    def mismatch(self, expected: dict[str, str]) -> str | None:
        names = {e.name for e in self.entries}
        if set(expected) != names:
            return f"tensors {sorted(names ^ set(expected))[:3]} missing or unknown"
        actual = self.digests()
        bad = [name for name in sorted(names) if actual[name] != expected[name]]
        return f"checksum mismatch in {bad[:3]} (torn or corrupt write)" if bad else None

    def bad_tensors(self) -> tuple[str, ...]:
        actual = self.digests()
        return tuple(e.name for e in self.entries if actual[e.name] != e.sha256)

    def seal(self, sha256: dict[str, str]) -> None:
        self.entries = [shm.TensorEntry(**{**e.__dict__, "sha256": sha256[e.name]}) for e in self.entries]
        manifest = json.dumps([e.__dict__ for e in self.entries]).encode()
        header = shm.read_weights_header(self.mm)
        assert len(manifest) == header.manifest_len, "sha256 strings are fixed-length"
        self.mm[shm.PAGE : shm.PAGE + len(manifest)] = manifest
        shm.set_weights_status(self.mm, shm.STATUS_OK)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        try:
            self.mm.close()
        except BufferError:  # a tensor view still exports it; the pages go with the process
            pass


def check_model_files(model_dir: Path) -> None:
    """Weights on disk must match the build manifest: a corrupt file never gets served."""

    manifest_file = model_dir / MANIFEST
    if not manifest_file.is_file():
        return
    expected = json.loads(manifest_file.read_text())["files"].get("model.safetensors")
    if expected and file_sha256(model_dir / "model.safetensors") != expected:
        raise shm.SharedMemoryError(
            f"{model_dir}/model.safetensors does not match its build manifest; rebuild with "
            "`belayer model build --force`"
        )


def vllm_layout(model_dir: Path, dtype: str) -> dict:
    """The model's weights file in vLLM's layout (see `to_vllm_layout`)."""

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        hf = {name: f.get_tensor(name) for name in f.keys()}
    return to_vllm_layout(hf, dtype)


# vLLM fuses these HF projections along dim 0 (row-major: the fused bytes are the parts' bytes
# one after another), in this order.
FUSED = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def vllm_parts(hf: dict, dtype: str) -> dict[str, list]:
    """vLLM parameter name → the HF tensors (in `dtype`, contiguous) whose concatenation it
    is, sorted by name. Names already in vLLM's layout pass through (a trainer may send
    either). A publisher writes the parts one after another: no fused copy is ever made."""
    import torch  # import cost: torch, ~2.5 s; the node process imports this module too

    target = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    parts: dict[str, list] = {}
    folded = {name for name in hf for suffixes in FUSED.values() if name.endswith(suffixes)}
    for name in hf:
        for fused, suffixes in FUSED.items():
            if name.endswith(suffixes[0]):
                base = name.removesuffix(suffixes[0])
                parts[base + fused] = [hf[base + suffix] for suffix in suffixes]
        if name not in folded:
            parts[name] = [hf[name]]
    return {name: [t.detach().to("cpu", target).contiguous() for t in parts[name]] for name in sorted(parts)}


def to_vllm_layout(hf: dict, dtype: str) -> dict:
    """HF Llama tensors → vLLM's Llama parameters (qkv and gate_up fused), in `dtype`."""
    import torch  # import cost: torch, ~2.5 s; the node process imports this module too

    return {name: p[0] if len(p) == 1 else torch.cat(p) for name, p in vllm_parts(hf, dtype).items()}


def plan_entries(tensors: dict) -> list[shm.TensorEntry]:
    entries, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append(shm.TensorEntry(name, dtype, tuple(t.shape), offset, nbytes, "0" * 64))
        offset = (offset + nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries
