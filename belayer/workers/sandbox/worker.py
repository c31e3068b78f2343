"""The sandbox host's Temporal worker: this host's queue plus the shared sandbox queue.

`python -m belayer.workers.sandbox` serves the activities of belayer/activities/sandbox.py
on `belayer-sandbox-<hostname>` (or `sandbox.host_task_queue`) -- where every call on a
sandbox living here goes -- and on the shared `belayer-sandbox` queue (create and
recover may run on any host). Ready once Temporal lists it as a poller of its host
queue (activity kind): that is the readiness check belayer/stack/workers.py performs.

Before serving it checks the runtime (podman, runc, CRIU, base image) and exits 2 with
the fixes when the host cannot run sandboxes, instead of accepting work it would fail;
then it fences the containers whose lineage moved to another host while it was away
(`SandboxHost.sweep_stale`).
"""

from __future__ import annotations

import asyncio
import logging
import sys

from belayer.activities.sandbox import SHARED_QUEUE, SandboxActivities
from belayer.config import BelayerConfig, load_config
from belayer.sandbox.host import default_host_queue, make_host


def host_queue(config: BelayerConfig) -> str:
    return default_host_queue(config.sandbox)


def check_host(config: BelayerConfig) -> list[str]:
    """Problems that keep this host from running sandboxes (empty: fine)."""
    from belayer.sandbox import runtime

    health = runtime.check_runtime(config.state_dir, config.cache_dir)
    return list(health.problems)


def remove_stale_temp_files(config: BelayerConfig) -> int:
    """Archives a previous worker downloaded for a restore it did not finish (it crashed).

    Only files untouched for an hour: another process on this host (a test, a bench) may
    be restoring right now.
    """
    import time

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


async def serve(config: BelayerConfig) -> None:
    from belayer.workers.runner import run_worker

    host = make_host(config, host_queue=host_queue(config))
    # A host coming back after its sandboxes were recovered elsewhere: remove what they left.
    fenced = await asyncio.to_thread(host.sweep_stale)
    if fenced:
        print(f"belayer sandbox worker: fenced superseded containers {', '.join(fenced)}", flush=True)
    activities = SandboxActivities(host)
    await run_worker(
        config.temporal,
        encryption_key=config.storage.encryption_key,
        role="sandbox",
        task_queues=[host.host_queue, SHARED_QUEUE],
        activities=activities.all(),
        max_concurrent_activities=16,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_config()
    problems = check_host(config)
    if problems:
        for p in problems:
            print(f"belayer sandbox worker: {p}", file=sys.stderr)
        return 2
    remove_stale_temp_files(config)
    print(f"belayer sandbox worker: serving {host_queue(config)} and {SHARED_QUEUE}", flush=True)
    asyncio.run(serve(config))
    return 0
