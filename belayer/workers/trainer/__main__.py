"""`python -m belayer.workers.trainer`: the trainer worker.

Serves `trainer.train_step` on `trainer.task_queue`, one activity at a time (a step uses
every thread it is given, and the trainer holds one state in memory).
"""

import sys

import torch

from belayer.activities.train import TrainerActivities, active_fault
from belayer.config import BelayerConfig
from belayer.storage.store import open_store
from belayer.trainer.step import Trainer
from belayer.workers.runner import main, run_worker


async def serve(config: BelayerConfig) -> None:
    active_fault()  # a mistyped fault spec stops the worker here, not in the first step
    torch.set_num_threads(config.trainer.threads)
    trainer = Trainer(cache_dir=config.cache_dir, device=config.trainer.device)
    await run_worker(
        config.temporal,
        encryption_key=config.storage.encryption_key,
        role="trainer",
        task_queues=[config.trainer.task_queue],
        activities=TrainerActivities(trainer, open_store(config.storage, encrypted=False)).all(),
        max_concurrent_activities=1,
    )


def banner(config: BelayerConfig) -> str:
    return f"belayer trainer worker: serving {config.trainer.task_queue}"


sys.exit(main(serve, banner))
