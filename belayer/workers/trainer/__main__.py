"""`python -m belayer.workers.trainer`: the trainer worker.

Serves `trainer.train_step` on `trainer.task_queue`, one activity at a time (a step uses
every thread it is given, and the trainer holds one state in memory).
"""

from __future__ import annotations

import asyncio
import logging
import sys

from belayer.config import BelayerConfig, load_config


async def serve(config: BelayerConfig) -> None:
    import torch

    from belayer.activities.train import TrainerActivities, active_fault
    from belayer.storage.store import ObjectStore
    from belayer.trainer.step import Trainer
    from belayer.workers.runner import run_worker

    active_fault()  # a mistyped fault spec stops the worker here, not in the first step
    torch.set_num_threads(config.trainer.threads)
    trainer = Trainer(cache_dir=config.cache_dir, device=config.trainer.device)
    await run_worker(
        config.temporal,
        encryption_key=config.storage.encryption_key,
        role="trainer",
        task_queues=[config.trainer.task_queue],
        activities=TrainerActivities(trainer, ObjectStore(config.storage)).all(),
        max_concurrent_activities=1,
    )


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_config()
    print(f"belayer trainer worker: serving {config.trainer.task_queue}", flush=True)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
