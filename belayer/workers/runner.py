"""Every Belayer worker process's `main`, and its Temporal worker run until SIGTERM or
SIGINT, then drained.

Shared by every worker process (workflow worker, trainer, sandbox host, rollout node):
each starts, reports and refuses the same way, and `belayer down` stopping one with
SIGTERM lets in-flight activity attempts finish or fail over instead of being cut
mid-write.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta

from temporalio.worker import Worker, WorkerTuner

from belayer.config import BelayerConfig, TemporalConfig, load_config
from belayer.errors import BelayerError
from belayer.temporal_client import connect

log = logging.getLogger(__name__)


class RefusedToServe(BelayerError):
    """This process must not serve (its host cannot, or a live process has its identity):
    `main` prints the message, which names the fix, and exits with `exit_code` instead of
    a traceback."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def main(
    serve: Callable[[BelayerConfig], Awaitable[None]],
    banner: Callable[[BelayerConfig], str],
    hold: Callable[[BelayerConfig], AbstractContextManager] = lambda _config: nullcontext(),
) -> int:
    """Run a worker process: log to stderr, load the effective configuration, take what
    `hold` holds for the life of the process (a claim on its identity; a check of its host
    that raises `RefusedToServe`), print `banner` (the stack's log shows what serves where),
    then `serve` until a stop signal. Returns the exit status: 0, or a refusal's."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_config()
    try:
        with hold(config):
            print(banner(config), flush=True)
            asyncio.run(serve(config))
    except RefusedToServe as exc:
        print(exc, file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


def worker_identity(role: str) -> str:
    """Shown in the Temporal UI next to every task this process handled."""
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
    tuners: Mapping[str, WorkerTuner] | None = None,
    before_stop: Callable[[int, Callable[[str], Awaitable[None]]], Awaitable[None]] | None = None,
) -> None:
    """Serve `task_queues` with the given workflows and activities until a stop signal;
    `queue_activities` adds activities served on one queue only; `tuners` replaces, for
    one queue, `max_concurrent_activities` by a tuner of its own (when that queue's worker
    may poll: belayer/workers/rollout/slots.py).

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
            graceful_shutdown_timeout=timedelta(seconds=5),
            **(
                {"tuner": tuners[queue]}
                if tuners and queue in tuners
                else {"max_concurrent_activities": max_concurrent_activities}
            ),
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
