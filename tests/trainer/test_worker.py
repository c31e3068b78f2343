"""The trainer worker process SIGKILLed mid-step: the retried activity on the restarted
worker gives the weights an uninterrupted step gives."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from belayer.config import TrainerConfig
from belayer.stack.workers import write_effective_config
from belayer.temporal_client import connect
from belayer.trainer.models import TrainStepArgs, TrainStepResult
from belayer.trainer.step import Trainer

from .conftest import batch, step_args


@workflow.defn(sandboxed=False)
class TrainOnce:
    """The training workflow's call, alone: retried on a lost heartbeat."""

    @workflow.run
    async def run(self, args: TrainStepArgs, queue: str) -> TrainStepResult:
        return await workflow.execute_activity(
            "trainer.train_step",
            args,
            task_queue=queue,
            result_type=TrainStepResult,
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(seconds=3),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=4),
        )


def spawn_trainer(config, fault: str) -> subprocess.Popen:
    config_file = write_effective_config(config, config.state_dir / "trainer.toml")
    env = dict(os.environ, BELAYER_CONFIG=str(config_file), BELAYER_TRAINER_FAULT=fault, PYTHONUNBUFFERED="1")
    log = open(config.state_dir / "trainer.log", "ab")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen(
        [sys.executable, "-m", "belayer.workers.trainer"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


async def test_a_trainer_killed_before_its_checkpoint_resumes_to_the_same_weights(
    temporal_server, stack_config, storage_config, store, tmp_path
):
    token = uuid.uuid4().hex[:8]
    config = stack_config.model_copy(
        update={
            "state_dir": tmp_path,
            "storage": storage_config,
            "trainer": TrainerConfig(task_queue=f"trainer-{token}", device="cpu"),
        }
    )
    samples = batch(store)
    args = step_args(f"run-{token}", samples)
    fault = f"crash_before_checkpoint:iteration=0;dir={tmp_path}"
    client = await connect(stack_config.temporal, stack_config.storage.encryption_key)
    first = spawn_trainer(config, fault)
    second = None
    try:
        async with Worker(client, task_queue=f"wf-{token}", workflows=[TrainOnce]):
            handle = await client.start_workflow(
                TrainOnce.run,
                args=[args, config.trainer.task_queue],
                id=f"train-{token}",
                task_queue=f"wf-{token}",
            )
            assert await asyncio.to_thread(first.wait, 180) == -signal.SIGKILL
            assert (tmp_path / f"belayer-trainer-fault-crash_before_checkpoint-{args.run_id}").exists()
            second = spawn_trainer(config, fault)  # the same environment: the fault does not fire again
            result = await asyncio.wait_for(handle.result(), timeout=180)
    finally:
        kill(first)
        if second is not None:
            kill(second)
    uninterrupted = Trainer(device="cpu").step(store, step_args(f"ref-{token}", samples))
    assert result.resumed_from == "built model"
    assert result.weights_sha256 == uninterrupted.weights_sha256
    assert result.checkpoint.sha256 == store.head(result.checkpoint.key).sha256
