"""Run a Temporal worker until SIGTERM or SIGINT, then drain and exit cleanly.

Shared by every Belayer worker process (workflow worker, sandbox host, rollout node),
so `belayer down` stopping one with SIGTERM lets in-flight activity attempts finish or
fail over instead of being cut mid-write.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta

from temporalio.worker import Worker

from belayer.config import TemporalConfig
from belayer.temporal_client import connect

log = logging.getLogger(__name__)


def worker_identity(role: str) -> str:
    """Shown in the Temporal UI next to every task this process handled."""
    import os

    return f"belayer-{role}@{socket.gethostname()}:{os.getpid()}"


async def run_worker(
    cfg: TemporalConfig,
    *,
    encryption_key=None,
    role: str,
    task_queues: Sequence[str],
    workflows: Sequence[type] = (),
    activities: Sequence[Callable] = (),
    queue_activities: Mapping[str, Sequence[Callable]] | None = None,
    max_concurrent_activities: int = 16,
    before_stop: Callable[[int, Callable[[str], Awaitable[None]]], Awaitable[None]] | None = None,
) -> None:
    """Serve `task_queues` with the given workflows and activities until a stop signal;
    `queue_activities` adds activities served on one queue only.

    `before_stop(signal, leave)` runs after the signal while every queue is still
    served; `leave(queue)` stops serving one of them (a draining sandbox host leaves the
    shared queue first and keeps answering on its own).

    `encryption_key` is `storage.encryption_key`, needed when payloads are encrypted.
    """
    client = await connect(cfg, encryption_key)
    identity = worker_identity(role)
    workers = [
        Worker(
            client,
            task_queue=queue,
            workflows=list(workflows),
            activities=[*activities, *(queue_activities or {}).get(queue, ())],
            identity=identity,
            max_concurrent_activities=max_concurrent_activities,
            graceful_shutdown_timeout=timedelta(seconds=5),
        )
        for queue in task_queues
    ]
    received: list[int] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda sig=sig: (received.append(sig), stop.set()))
    log.info("%s serving %s", identity, ", ".join(task_queues))
    runs = [asyncio.create_task(worker.run()) for worker in workers]
    serving = dict(zip(task_queues, workers, strict=True))

    async def leave(queue: str) -> None:
        if (worker := serving.pop(queue, None)) is not None:
            await worker.shutdown()

    await stop.wait()
    if before_stop is not None:
        await before_stop(received[0], leave)
    log.info("%s stopping", identity)
    await asyncio.gather(*(leave(queue) for queue in list(serving)))
    await asyncio.gather(*runs, return_exceptions=True)
