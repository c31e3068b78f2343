"""Every live sandbox of the local stack, on every host: `belayer sandboxes`.

A sandbox is listed with the workflow it serves (the owner its host recorded,
belayer/sandbox/reaper.py) and how Temporal says that workflow stands, so a sandbox
that outlived its trajectory is visible as such; its age, memory (its memory cgroup,
the tmpfs mounts included) and disk (its writable layer) say what it costs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from temporalio.client import Client

from belayer.config import BelayerConfig
from belayer.sandbox.reaper import OwnerRecords
from belayer.sandbox.staging import Staging
from belayer.stack import sandbox_hosts
from belayer.temporal_client import workflow_status


@dataclass(frozen=True)
class LiveSandbox:
    """One sandbox as `belayer sandboxes` lists it."""

    sandbox_id: str
    host: str
    container: str
    state: str  # running / stopped (a container that is not running still holds its disk)
    trajectory: str | None  # the workflow it serves (= trajectory id); None: no workflow started it
    workflow_status: str | None  # Temporal's word for that workflow (RUNNING, TERMINATED, UNKNOWN...)
    age_s: float
    memory_bytes: int | None
    disk_bytes: int | None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HostStaging:
    """A host's staging disk (belayer/sandbox/staging.py): checkpoints waiting for upload,
    archives being restored from and the cached archives forks start from, against its budget."""

    host: str
    staged_bytes: int
    importing_bytes: int
    cached_bytes: int
    budget_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SandboxListing:
    sandboxes: list[LiveSandbox]
    hosts_down: list[str]  # hosts of the stack whose sandboxes could not be listed
    staging: list[HostStaging]


async def list_sandboxes(config: BelayerConfig, hosts: int, client: Client | None) -> SandboxListing:
    """The sandboxes of hosts 0..hosts-1; without a client, no workflow status."""
    found: list[LiveSandbox] = []
    down: list[str] = []
    now = time.time()
    statuses: dict[str, str | None] = {}
    staging = [_staging(config, k) for k in range(hosts)]
    for k in range(hosts):
        backend = sandbox_hosts.backend_on(config, k)
        if backend is None:
            down.append(sandbox_hosts.host_name(k))
            continue
        owners = OwnerRecords(config.state_dir, sandbox_hosts.host_queue(config, k)).all()
        for facts in backend.container_facts():
            owner = owners.get(facts.sandbox_id)
            if owner is not None and owner not in statuses:
                statuses[owner] = None if client is None else await workflow_status(client, owner)
            found.append(LiveSandbox(
                sandbox_id=facts.sandbox_id, host=sandbox_hosts.host_name(k), container=facts.name,
                state="running" if facts.running else "stopped", trajectory=owner,
                workflow_status=statuses.get(owner) if owner else None, age_s=round(max(0.0, now - facts.created), 1),
                memory_bytes=facts.memory_bytes, disk_bytes=facts.disk_bytes,
            ))  # fmt: skip
    return SandboxListing(
        sandboxes=sorted(found, key=lambda s: (s.host, -s.age_s)), hosts_down=down, staging=staging
    )


def _staging(config: BelayerConfig, k: int) -> HostStaging:
    queue = sandbox_hosts.host_queue(config, k)
    usage = Staging(config.state_dir, lambda: queue, config.sandbox.staging_budget_mb << 20).usage()
    return HostStaging(
        host=sandbox_hosts.host_name(k),
        staged_bytes=usage.staged_bytes,
        importing_bytes=usage.importing_bytes,
        cached_bytes=usage.cached_bytes,
        budget_bytes=usage.budget_bytes,
    )
