"""What a run left behind, counted from the hosts themselves, not from Belayer's records:
sandbox containers (`podman ps -a` in each sandbox host's storage), processes, network
namespaces, /dev/shm segments, each host's channel directories and archives being
imported, staged captures, and objects in the store.

A snapshot is taken before a soak and another after it; a leak is what the second has
and the first had not, minus what the live stack legitimately holds (its services and
their children, live containers, the rollout node's current segments). Nothing here
removes anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
from pydantic import BaseModel

from belayer.config import BelayerConfig
from belayer.rollout.shm import leftover_segments
from belayer.sandbox.lineage import lineage_prefix
from belayer.sandbox.staging import IMPORTS_DIR, STAGED_DIR
from belayer.stack import sandbox_hosts
from belayer.stack.local import LocalStack
from belayer.storage.store import RECORD_ROOT, open_store


class Leaks(BaseModel):
    containers: list[str] = []
    processes: list[str] = []
    network_namespaces: list[str] = []
    shm_segments: list[str] = []
    channel_dirs: list[str] = []
    imports: list[str] = []
    objects: list[str] = []

    def counts(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in Leaks.model_fields}


class Snapshot(BaseModel):
    containers: set[str]
    processes: set[int]
    network_namespaces: set[int] = set()


def snapshot(config: BelayerConfig) -> Snapshot:
    return Snapshot(
        containers=set(sandbox_containers(config)),
        processes={p.pid for p in stack_processes(config)},
        network_namespaces=set(network_namespaces()),
    )


def find_leaks(config: BelayerConfig, before: Snapshot, sandbox_ids: set[str]) -> Leaks:
    """Everything the run left that nothing live explains; `sandbox_ids` are the run's
    sandboxes, every one of them finished."""
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
        network_namespaces=new_network_namespaces(before, live),
        shm_segments=unmapped_segments(config),
        channel_dirs=channel_dirs_of(config, sandbox_ids),
        imports=importing_files(config),
        objects=leftover_objects(config, sandbox_ids),
    )


def network_namespaces() -> dict[int, str]:
    """Every network namespace of the machine by inode, with what holds it: a process, or
    a bind mount (a named namespace) seen in some process's mount table."""
    held: dict[int, str] = {}
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            held.setdefault(os.stat(pid_dir / "ns" / "net").st_ino, f"process {pid_dir.name}")
            for line in (pid_dir / "mountinfo").read_text().splitlines():
                fields = line.split(" - ")
                if len(fields) == 2 and fields[1].startswith("nsfs ") and "net:[" in line:
                    inode = int(line.split("net:[", 1)[1].split("]", 1)[0])
                    held.setdefault(inode, f"bind mount {line.split()[4]}")
        except (OSError, ValueError):
            continue
    return held


def new_network_namespaces(before: Snapshot, live: set[int]) -> list[str]:
    """Network namespaces created since `before` that no live service or container holds."""
    explained = set(before.network_namespaces)
    for pid in live:
        try:
            explained.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except OSError:
            continue
    return [f"net:[{inode}] held by {holder}" for inode, holder in network_namespaces().items()
            if inode not in explained]  # fmt: skip


def channel_dirs_of(config: BelayerConfig, sandbox_ids: set[str]) -> list[str]:
    """Channel directories of finished sandboxes on any host (destroying one removes its own)."""
    return [
        str(path)
        for k in range(LocalStack(config).sandbox_hosts)
        for path in sorted((sandbox_hosts.host_dir(config, k) / "channels").glob("*"))
        if path.name in sandbox_ids
    ]


def importing_files(config: BelayerConfig) -> list[str]:
    """Archives still under a host's imports directory: one exists only while its restore
    or fork runs, so after a run nothing should be there."""
    root = config.state_dir / "tmp" / IMPORTS_DIR
    return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


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
