"""What a run left behind: sandbox containers, processes, shared memory, objects.

A snapshot is taken before a soak and another after it; a leak is what the second has
and the first had not, minus what the live stack legitimately holds (its services and
their children, the rollout node's current segments). Nothing here removes anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
from pydantic import BaseModel

from belayer.config import BelayerConfig
from belayer.rollout.shm import leftover_segments
from belayer.sandbox.lineage import lineage_prefix
from belayer.sandbox.staging import STAGED_DIR
from belayer.stack import sandbox_hosts
from belayer.stack.local import LocalStack
from belayer.storage.store import RECORD_ROOT, open_store


class Leaks(BaseModel):
    containers: list[str] = []
    processes: list[str] = []
    shm_segments: list[str] = []
    objects: list[str] = []

    def counts(self) -> dict[str, int]:
        return {
            name: len(getattr(self, name)) for name in ("containers", "processes", "shm_segments", "objects")
        }


class Snapshot(BaseModel):
    containers: set[str]
    processes: set[int]


def snapshot(config: BelayerConfig) -> Snapshot:
    return Snapshot(
        containers=set(sandbox_containers(config)), processes={p.pid for p in stack_processes(config)}
    )


def find_leaks(config: BelayerConfig, before: Snapshot, sandbox_ids: set[str]) -> Leaks:
    """Everything the run left that nothing live explains."""
    containers = [c for c in sandbox_containers(config) if c not in before.containers]
    live = _service_trees(config)
    processes = [
        f"{p.pid} {' '.join(_cmdline(p))[:120]}"
        for p in stack_processes(config)
        if p.pid not in before.processes and p.pid not in live
    ]
    return Leaks(
        containers=containers,
        processes=processes,
        shm_segments=unmapped_segments(config),
        objects=leftover_objects(config, sandbox_ids),
    )


def sandbox_containers(config: BelayerConfig) -> list[str]:
    """Names of every Belayer sandbox container of this state directory (any state), on
    every sandbox host of its stack."""

    return [
        name
        for k in range(LocalStack(config).sandbox_hosts)
        for name in sandbox_hosts.containers_on(config, k)
    ]


def stack_processes(config: BelayerConfig) -> list[psutil.Process]:
    """Processes that belong to this state directory's stack: their environment or command
    line names it (a default state directory too: see below). The calling process and its ancestors are not counted."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    marker = str(config.state_dir)
    found = []
    for proc in psutil.process_iter():
        if proc.pid in mine:
            continue
        try:
            # workers the stack starts carry its effective-config path (in the state
            # directory) in their environment, and their children inherit it
            env = proc.environ()
            if any(marker in value for value in env.values()) or marker in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _service_trees(config: BelayerConfig) -> set[int]:
    """Pids of the stack's running services, their children, and the conmon of live containers."""

    stack = LocalStack(config)
    pids: set[int] = set()
    for service in stack.services:
        proc = stack.process(service).running()
        if proc is None:
            continue
        pids.add(proc.pid)
        try:
            pids.update(child.pid for child in proc.children(recursive=True))
        except psutil.Error:
            pass
    for proc in psutil.process_iter(["name", "cmdline"]):
        # conmon and a container's own processes belong to a container: counted as containers.
        try:
            if proc.info["name"] == "conmon":
                pids.add(proc.pid)
                pids.update(child.pid for child in proc.children(recursive=True))
        except psutil.Error:
            continue
    return pids


def unmapped_segments(config: BelayerConfig) -> list[str]:
    """The /dev/shm segments of the stack's rollout nodes that no live process maps or holds open."""

    segments = {
        str(p)
        for node in LocalStack(config).rollout_node_configs()
        for p in leftover_segments(node.rollout.node_id)
    }
    if not segments:
        return []
    used: set[str] = set()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for line in (pid_dir / "maps").read_text().splitlines():
                path = line.rpartition(" ")[2]
                if path in segments:
                    used.add(path)
            for fd in (pid_dir / "fd").iterdir():
                target = os.readlink(fd)
                if target in segments:
                    used.add(target)
        except OSError:
            continue
    return sorted(segments - used)


def leftover_objects(config: BelayerConfig, sandbox_ids: set[str]) -> list[str]:
    """Checkpoint objects of finished sandboxes (destroy deletes them), unfinished
    multipart uploads and captures never published. Token logs and observations are the trajectories' record, and
    lineage records outlive their sandboxes on purpose (a host that comes back must still
    learn its container is stale: belayer/sandbox/lineage.py): kept, not leaks."""

    found: list[str] = []
    with open_store(config.storage, encrypted=False) as store:
        for sandbox_id in sorted(sandbox_ids):
            prefix = f"{config.sandbox.checkpoint_prefix}{sandbox_id}/"
            kept = lineage_prefix(config.sandbox.checkpoint_prefix, sandbox_id)
            found.extend(key for key in store.list(prefix) if not key.startswith(kept))
            # hash records of multipart archives live apart from their objects
            found.extend(store._list_full(config.storage.key_prefix + RECORD_ROOT + prefix))
            uploads = store.client.list_multipart_uploads(
                Bucket=config.storage.bucket, Prefix=config.storage.key_prefix + prefix
            ).get("Uploads", [])
            found.extend(f"incomplete upload {u['Key']}" for u in uploads)
    return found + unpublished_captures(config, sandbox_ids)


def unpublished_captures(config: BelayerConfig, sandbox_ids: set[str]) -> list[str]:
    """Checkpoints of finished sandboxes captured on their host and never published:
    destroying a sandbox removes its own (each host's in a directory of its own)."""

    staged = config.state_dir / STAGED_DIR
    return [
        f"unpublished capture {path}"
        for sandbox_id in sorted(sandbox_ids)
        for path in sorted(staged.rglob(f"{sandbox_id}--*.tar"))
    ]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return ["?"]
