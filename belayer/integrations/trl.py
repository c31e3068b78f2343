"""TRL's `GRPOTrainer` with Belayer as its rollout backend and its weight sync.

TRL computes the loss and takes the optimizer step; Belayer runs the multi-turn rollouts
(groups forked from one set-up sandbox, engine and sandbox failures recovered, failed
members retried with the same seed) and serves each new version of the weights. What a
`GRPOTrainer` user adds:

    rollouts = BelayerRollouts.connect("examples/workloads/learn.yaml")
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, args=GRPOConfig(...),
        train_dataset=rollouts.dataset(), reward_funcs=rollouts.reward,
        rollout_func=rollouts.rollout_func, callbacks=[rollouts.weight_sync()],
    )
    trainer.train()

TRL's seam is `rollout_func` (installed TRL 1.16: experimental, outside its vLLM mode too):
it gets the prompts of a generation batch and returns token ids, the engine's logprobs and
`env_mask`, which TRL multiplies into its loss mask, so observation tokens never count.
The dataset's prompts are task ids (Belayer renders each task's own prompt); TRL's
`RepeatSampler` hands each one `num_generations` times in a row, and each such run is one
Belayer group. The rollouts sample at `GRPOConfig.temperature`, the temperature TRL's loss
divides the logits by, so the two cannot differ.

Weights: when training begins the trainer's own weights are published as a new version,
and after every optimizer step the updated ones as the next; each batch is pinned to the
version just published (`weights_version`), so a node that missed it fails the batch
instead of sampling from stale weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import warnings
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from datasets import Dataset
from transformers import TrainerCallback

from belayer.config import BelayerConfig
from belayer.rollouts import Rollout, RolloutClient, RolloutError
from belayer.workloads.loader import load_workload
from belayer.workloads.models import Task

T = TypeVar("T")
SEED_RANGE = 2**31  # what a batch's seed may be (RolloutSettings)


class BelayerRollouts:
    """The rollout function, reward function and weight sync one `GRPOTrainer` uses."""

    def __init__(self, tasks: Sequence[Task], client: RolloutClient, loop: asyncio.AbstractEventLoop,
                 *, seed: int = 0) -> None:  # fmt: skip
        self.tasks = {task.id: task for task in tasks}
        self.client = client
        self.seed = seed
        self.version: int | None = None  # the version the next batch is pinned to
        self.step: int | None = None  # the trainer step of the batch running or last run
        self._base_version: int | None = None  # the version of step 0
        self.batches: list[list[Rollout]] = []  # every batch, in order (a run's record)
        self._warned = False
        self._loop = loop

    @classmethod
    def connect(cls, tasks: str | Path | Sequence[Task], *, config: BelayerConfig | None = None,
                seed: int = 0) -> BelayerRollouts:  # fmt: skip
        """Rollouts of `tasks` (a workload file or task objects) on the running stack
        `config` names (default: the effective configuration, as `belayer` commands read it)."""
        tasks = load_workload(Path(tasks)).tasks if isinstance(tasks, str | Path) else list(tasks)
        if len({task.id for task in tasks}) != len(tasks):
            raise RolloutError(
                "the tasks name an id twice; a task id is the prompt TRL hands back: make them unique"
            )
        loop = asyncio.new_event_loop()  # the Temporal client lives on it, in a thread of its own
        threading.Thread(target=loop.run_forever, name="belayer-rollouts", daemon=True).start()
        client = asyncio.run_coroutine_threadsafe(RolloutClient.connect(config), loop).result()
        return cls(tasks, client, loop, seed=seed)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # ------------------------------------------------------------------ what TRL calls

    def dataset(self) -> Dataset:
        """The training prompts: one row per task, its id as the prompt."""
        return Dataset.from_dict({"prompt": list(self.tasks)})

    def rollout_func(self, prompts: list[str], trainer) -> dict[str, list]:
        """TRL's `rollout_func`: a group of `num_generations` rollouts per run of prompts."""
        group_size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        if trainer.model.training and self.version is None:
            raise RolloutError(
                "no weights were published for this run, so the rollouts would sample from whatever "
                "the nodes serve: pass callbacks=[rollouts.weight_sync()] to the GRPOTrainer"
            )
        self.step = trainer.state.global_step
        self._warn_of_precision(trainer.args)
        tasks = self._groups(prompts, group_size)
        rollouts: list[Rollout] = []
        for index, batch in enumerate(_without_repeats(tasks)):
            rollouts += self._run(self.client.generate(
                batch, group_size=group_size, seed=self._seed(trainer.state.global_step, index),
                temperature=trainer.args.temperature, weights_version=self.version,
            ))  # fmt: skip
        rollouts = _in_order(rollouts, tasks)
        if failed := [r for r in rollouts if r.status == "failed_infra"]:
            raise RolloutError(
                f"{len(failed)} rollout(s) failed on infrastructure after Belayer's retries, "
                f"first {failed[0].trajectory_id}: {failed[0].reason}; a group with one would train on no "
                "reward, so the step stops here (see `belayer inspect`)"
            )
        self.batches.append(rollouts)
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": [r.logprobs for r in rollouts],
            "env_mask": [r.loss_mask for r in rollouts],
            "belayer_reward": [r.reward for r in rollouts],
            "belayer_trajectory": [r.trajectory_id for r in rollouts],
        }

    def reward(self, completions, belayer_reward: list[float], **_) -> list[float]:
        """TRL's reward function: the reward Belayer's verifier gave each rollout, judged
        from the sandbox's state out of the agent's reach."""
        return [float(reward) for reward in belayer_reward]

    def weight_sync(self) -> WeightSync:
        """The `TrainerCallback` that keeps the nodes on the trainer's weights."""
        return WeightSync(self)

    # ------------------------------------------------------------------ weights

    def publish(self, model, step: int) -> int:
        """Publish `model`'s weights as the version for `step`; returns it."""
        if self._base_version is None:  # the first publish: above whatever the nodes serve
            served = self._run(self.client.served_versions())
            self._base_version = max(served.values()) + 1 - step
        version = self._base_version + step
        state = {
            name: tensor.detach().to("cpu").clone().contiguous()
            for name, tensor in model.state_dict().items()
        }
        self._run(self.client.publish(state, version))
        self.version = version
        return version

    # ------------------------------------------------------------------ helpers

    def _warn_of_precision(self, args) -> None:
        """TRL's default bf16 autocast scores the tokens in bf16 while fp32 engines sampled
        them: its logprobs then differ from the engines' (by up to 0.06 on the tiny model)."""
        if (
            getattr(args, "bf16", False)
            and self.client.config.rollout.dtype == "float32"
            and not self._warned
        ):
            self._warned = True
            warnings.warn(
                "GRPOConfig(bf16=True) computes TRL's logprobs in bf16 but the engines sample in float32 "
                "(rollout.dtype): pass bf16=False to train on the numbers the engines sampled with",
                stacklevel=3,
            )

    def _groups(self, prompts: list[str], group_size: int) -> list[Task]:
        """The task of each run of `group_size` equal prompts (TRL's RepeatSampler order)."""
        if len(prompts) % group_size:
            raise RolloutError(f"{len(prompts)} prompts are not runs of num_generations={group_size}")
        tasks = []
        for start in range(0, len(prompts), group_size):
            run = prompts[start : start + group_size]
            if len(set(run)) != 1:
                raise RolloutError(
                    f"prompts {run} should be one prompt {group_size} times (TRL's RepeatSampler order)"
                )
            if run[0] not in self.tasks:
                raise RolloutError(
                    f"prompt {run[0]!r} is no task id of this BelayerRollouts; use its dataset()"
                )
            tasks.append(self.tasks[run[0]])
        return tasks

    def _seed(self, step: int, batch: int) -> int:
        """A batch's seed: the same step of the same run samples the same tokens, and no
        two batches of a run share one."""
        digest = hashlib.blake2b(f"{self.seed}:{step}:{batch}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % SEED_RANGE


class WeightSync(TrainerCallback):
    """Publishes the trainer's weights to every rollout node: when training begins (the
    version the first batch samples from) and after every optimizer step."""

    def __init__(self, rollouts: BelayerRollouts) -> None:
        self.rollouts = rollouts

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            self.rollouts.publish(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            self.rollouts.publish(model, state.global_step)


def _without_repeats(tasks: list[Task]) -> list[list[Task]]:
    """`tasks` cut into batches that name no task twice (a group is named after its task)."""
    batches: list[list[Task]] = []
    for task in tasks:
        batch = next((b for b in batches if all(t.id != task.id for t in b)), None)
        if batch is None:
            batches.append(batch := [])
        batch.append(task)
    return batches


def _in_order(rollouts: list[Rollout], tasks: list[Task]) -> list[Rollout]:
    """The rollouts back in the order of `tasks` (each task's group, members in order)."""
    by_task: dict[str, list[list[Rollout]]] = {}
    for rollout in rollouts:
        groups = by_task.setdefault(rollout.task_id, [])
        if rollout.member == 0:
            groups.append([])
        groups[-1].append(rollout)
    ordered = []
    for task in tasks:
        ordered += by_task[task.id].pop(0)
    return ordered
