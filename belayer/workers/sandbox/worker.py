"""The sandbox host's Temporal worker: this host's queue plus the shared sandbox queue.

`python -m belayer.workers.sandbox` serves the activities of belayer/activities/sandbox.py
on `belayer-sandbox-<hostname>` (or `sandbox.host_task_queue`) -- where every call on a
sandbox living here goes -- and on the shared `belayer-sandbox` queue (create and
recover may run on any host). Ready once Temporal lists it as a poller of its host
queue (activity kind): that is the readiness check belayer/stack/workers.py performs.

Before serving it checks the runtime (podman, runc, CRIU, base image) and exits 2 with
the fixes when the host cannot run sandboxes, instead of accepting work it would fail;
then it fences the containers whose lineage moved to another host while it was away
(`SandboxHost.sweep_stale`). While it serves, every `sandbox.reap_interval_s` it removes the
sandboxes whose workflow has closed without destroying them (terminated from Temporal, timed
out): belayer/sandbox/reaper.py.

SIGTERM -- what a platform sends before it takes the machine away -- drains the host
(belayer/sandbox/drain.py) within `sandbox.drain_deadline_s`, or the deadline `belayer
drain` left in the request file, and then exits; SIGINT stops at once (`belayer down`:
the whole stack goes, there is nowhere to move to). The drain's report is written, as
it goes, next to the request (`drain_files`), and printed to the log at the end.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from temporalio.client import Client

from belayer.activities.sandbox import SHARED_QUEUE, SandboxActivities
from belayer.config import BelayerConfig
from belayer.sandbox.backends import open_backend
from belayer.sandbox.drain import DrainReport, drain_host
from belayer.sandbox.host import SandboxHost, default_host_queue, make_host
from belayer.sandbox.placement import LoadPublisher
from belayer.sandbox.reaper import Reaped, owned_sandboxes, reap
from belayer.temporal_client import connect, workflow_status
from belayer.workers.runner import RefusedToServe, run_worker


def host_queue(config: BelayerConfig) -> str:
    return default_host_queue(config.sandbox)


def check_host(config: BelayerConfig) -> list[str]:
    """Problems that keep this host from running sandboxes (empty: fine)."""
    return open_backend(config.sandbox, config.state_dir, config.cache_dir).health().problems


def remove_stale_temp_files(config: BelayerConfig) -> int:
    """Archives a previous worker downloaded for a restore it did not finish (it crashed).

    Only files untouched for an hour: another process on this host (a test, a bench) may
    be restoring right now.
    """
    tmp = config.state_dir / "tmp"
    removed = 0
    for pattern in ("restore-sbx-*.tar", "ckpt-sbx-*.err"):
        for path in tmp.glob(pattern):
            try:
                if time.time() - path.stat().st_mtime > 3600:
                    path.unlink()
                    removed += 1
            except OSError:
                continue
    return removed


def drain_files(config: BelayerConfig, host_queue: str) -> tuple[Path, Path]:
    """The request `belayer drain` leaves before its SIGTERM (the deadline), and the report."""
    run = config.state_dir / "run"
    return run / f"drain-{host_queue}.request.json", run / f"drain-{host_queue}.report.json"


def requested_deadline(config: BelayerConfig, host_queue: str) -> float:
    request, _ = drain_files(config, host_queue)
    try:
        deadline = float(json.loads(request.read_text())["deadline_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return config.sandbox.drain_deadline_s
    request.unlink(missing_ok=True)
    return deadline


async def drain_on_sigterm(config: BelayerConfig, host: SandboxHost, sig: int,
                           leave: Callable[[str], Awaitable[None]]) -> None:  # fmt: skip
    """Run by the worker after a stop signal, while it still serves its own queue."""
    if sig != signal.SIGTERM:
        return
    deadline = requested_deadline(config, host.host_queue)
    if deadline <= 0:
        return
    host.draining = True  # before leaving: a create or restore already running here is refused
    host.on_load_change()  # placement stops choosing this host
    await leave(SHARED_QUEUE)
    _, report_file = drain_files(config, host.host_queue)
    report_file.parent.mkdir(parents=True, exist_ok=True)

    def write(report: DrainReport) -> None:
        partial = report_file.with_suffix(".tmp")
        partial.write_text(report.model_dump_json(indent=2))
        partial.replace(report_file)

    print(f"belayer sandbox worker: draining {host.host_queue} within {deadline:.0f}s", flush=True)
    report = await asyncio.to_thread(drain_host, host, deadline, concurrency=config.sandbox.drain_concurrency,
                                     progress=write)  # fmt: skip
    for s in report.sandboxes:
        print(
            f"belayer sandbox worker: drain: {s.sandbox_id} {s.outcome} (step {s.step}, waited {s.waited_s:.2f}s, "
            f"paused {s.paused_s:.2f}s){' ' + s.detail if s.detail else ''}",
            flush=True,
        )
    print(f"belayer sandbox worker: drained in {report.emptied_s:.2f}s: {report.counts()}", flush=True)


async def reap_closed_workflows(config: BelayerConfig, host: SandboxHost) -> None:
    """Every `sandbox.reap_interval_s`, a `reap_round`; runs as long as the worker."""
    interval = config.sandbox.reap_interval_s
    if interval <= 0:
        return
    client: Client | None = None
    while True:
        await asyncio.sleep(interval)
        try:
            client = client or await connect(config.temporal, config.storage.encryption_key)
            reaped = await reap_round(client, host)
        except Exception as exc:  # the next round tries again; serving goes on meanwhile
            print(f"belayer sandbox worker: reaper round failed: {exc}", flush=True)
            continue
        for r in reaped:
            print(f"belayer sandbox worker: reaped sandbox {r.sandbox_id}: its workflow {r.workflow_id} is "
                  f"{r.workflow_status.lower()}", flush=True)  # fmt: skip


async def reap_round(client: Client, host: SandboxHost) -> list[Reaped]:
    """Remove the sandboxes here whose workflow has closed or is unknown to Temporal
    (belayer/sandbox/reaper.py)."""
    live = await asyncio.to_thread(host.backend.lineages)
    owners = set(owned_sandboxes(live, host.owners).values())
    statuses = {workflow_id: await workflow_status(client, workflow_id) for workflow_id in owners}
    answered = {workflow_id: status for workflow_id, status in statuses.items() if status is not None}
    return await asyncio.to_thread(reap, live, host.owners, answered, host.remove)


async def serve(config: BelayerConfig) -> None:
    host = make_host(config, host_queue=host_queue(config))
    # A host coming back after its sandboxes were recovered elsewhere: remove what they left.
    fenced = await asyncio.to_thread(host.sweep_stale)
    if fenced:
        print(f"belayer sandbox worker: fenced superseded containers {', '.join(fenced)}", flush=True)
    host.adopt_existing()
    left = await asyncio.to_thread(host.staging.drop_imports)
    if left:
        print(
            f"belayer sandbox worker: removed {left} archives an earlier worker left mid-import", flush=True
        )
    publisher = LoadPublisher(host).start()
    reaper = asyncio.create_task(reap_closed_workflows(config, host))
    try:
        await run_worker(
            config.temporal,
            encryption_key=config.storage.encryption_key,
            role="sandbox",
            task_queues=[host.host_queue, SHARED_QUEUE],
            activities=SandboxActivities(host).all(),
            max_concurrent_activities=16,
            before_stop=lambda sig, leave: drain_on_sigterm(config, host, sig, leave),
        )
    finally:
        reaper.cancel()
        await asyncio.to_thread(publisher.stop)  # placement stops choosing this host
        await asyncio.to_thread(host.staging.drop_cache)  # a cache: a later worker downloads again


def banner(config: BelayerConfig) -> str:
    return f"belayer sandbox worker: serving {host_queue(config)} and {SHARED_QUEUE}"


@contextmanager
def able_host(config: BelayerConfig) -> Iterator[None]:
    """Refuse to serve (exit status 2, the fixes printed) on a host that cannot run
    sandboxes, instead of accepting work it would fail; else tidy what a crashed
    predecessor left."""
    problems = check_host(config)
    if problems:
        raise RefusedToServe("\n".join(f"belayer sandbox worker: {p}" for p in problems), exit_code=2)
    remove_stale_temp_files(config)
    yield
