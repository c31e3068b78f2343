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
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path

from belayer.workers.rollout import faults, shm
from belayer.workers.rollout.procutil import die_with_parent
from belayer.workers.rollout.protocol import (
    Failed,
    OwnerReady,
    OwnerSpec,
    Stop,
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
    def __init__(self, spec: OwnerSpec):
        self.spec = spec
        self.weights_path = shm.weights_path(spec.node_id, spec.generation)
        self.arena_path = shm.arena_path(spec.node_id, spec.generation)
        self.mm = None
        self.entries: list[shm.TensorEntry] = []
        self.data_offset = 0

    def load(self) -> OwnerReady:
        t0 = time.perf_counter()
        check_model_files(self.spec.model_dir)
        tensors = vllm_layout(self.spec.model_dir, self.spec.dtype)
        self.entries = plan_entries(tensors)
        self.mm = shm.create_weights_segment(self.weights_path, self.entries, version=1)
        header = shm.read_weights_header(self.mm)
        self.data_offset = header.data_offset
        entries = []
        for entry, tensor in zip(self.entries, tensors.values(), strict=True):
            self._write(entry, tensor)
            entries.append(shm.TensorEntry(**{**entry.__dict__, "sha256": self._digest(entry)}))
        self.entries = entries
        self._rewrite_manifest()
        shm.set_weights_status(self.mm, shm.STATUS_OK)
        shm.create_arena(self.arena_path, self.spec.kv_bytes)
        params = sum(t.numel() for t in tensors.values())
        return OwnerReady(
            pid=os.getpid(),
            weights_path=self.weights_path,
            arena_path=self.arena_path,
            load_s=time.perf_counter() - t0,
            params=params,
            weight_bytes=sum(e.nbytes for e in self.entries),
        )

    def serve(self, conn: Connection) -> None:
        selected = faults.active()
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
                if isinstance(msg, VerifyWeights):
                    conn.send(self.verify())
            now = time.monotonic()
            if crash_at is not None and now >= crash_at:
                faults.die_now()
            if next_verify is not None and now >= next_verify:
                result = self.verify()
                if not result.ok:
                    conn.send(result)  # unsolicited: the supervisor cold-starts on it
                next_verify = now + interval
        self.close()

    def verify(self) -> WeightsVerified:
        t0 = time.perf_counter()
        bad = tuple(e.name for e in self.entries if self._digest(e) != e.sha256)
        shm.set_weights_status(self.mm, shm.STATUS_CORRUPT if bad else shm.STATUS_OK)
        return WeightsVerified(ok=not bad, bad_tensors=bad, seconds=time.perf_counter() - t0)

    def close(self) -> None:
        for path in (self.weights_path, self.arena_path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def _write(self, entry: shm.TensorEntry, tensor) -> None:
        import torch

        start = self.data_offset + entry.offset
        view = torch.frombuffer(self.mm, dtype=tensor.dtype, count=tensor.numel(), offset=start)
        view.copy_(tensor.reshape(-1))

    def _digest(self, entry: shm.TensorEntry) -> str:
        start = self.data_offset + entry.offset
        with memoryview(self.mm) as mv:
            return hashlib.sha256(mv[start : start + entry.nbytes]).hexdigest()

    def _rewrite_manifest(self) -> None:
        manifest = json.dumps([e.__dict__ for e in self.entries]).encode()
        header = shm.read_weights_header(self.mm)
        assert len(manifest) == header.manifest_len, "sha256 strings are fixed-length"
        self.mm[shm.PAGE : shm.PAGE + len(manifest)] = manifest


def check_model_files(model_dir: Path) -> None:
    """Weights on disk must match the build manifest: a corrupt file never gets served."""
    from belayer.model.build import MANIFEST, file_sha256

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
    """HF Llama tensors → vLLM's Llama parameter names (qkv and gate_up fused), in `dtype`."""
    import torch
    from safetensors import safe_open

    target = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        hf = {name: f.get_tensor(name) for name in f.keys()}
    out: dict[str, object] = {}
    for name in sorted(hf):
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")):
            continue  # folded into the fused tensor below
        if name.endswith("self_attn.q_proj.weight"):
            base = name.removesuffix("q_proj.weight")
            fused = torch.cat(
                [hf[base + "q_proj.weight"], hf[base + "k_proj.weight"], hf[base + "v_proj.weight"]]
            )
            out[base + "qkv_proj.weight"] = fused
        elif name.endswith("mlp.gate_proj.weight"):
            base = name.removesuffix("gate_proj.weight")
            out[base + "gate_up_proj.weight"] = torch.cat(
                [hf[base + "gate_proj.weight"], hf[base + "up_proj.weight"]]
            )
        else:
            out[name] = hf[name]
    return {name: t.to(target).contiguous() for name, t in out.items()}


def plan_entries(tensors: dict) -> list[shm.TensorEntry]:
    entries, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append(shm.TensorEntry(name, dtype, tuple(t.shape), offset, nbytes, "0" * 64))
        offset = (offset + nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries
