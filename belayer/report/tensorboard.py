"""A training run's iteration records as TensorBoard event files (`belayer train --logdir`).

One scalar per metric per iteration (the step), under the run's id, so several runs in
one logdir show side by side: rewards (the mean, held-out, per task family), the trainer's
numbers (loss, KL, clip fraction, entropy, gradient norm, learning rate), what the policy
did (response tokens, actions per trajectory) and where the time went. Written as the
records arrive; a record already written is not written again.
"""

from __future__ import annotations

import re
from pathlib import Path

_FAMILY_SUFFIX = re.compile(r"[-_.]?\d+$")


def task_family(task_id: str) -> str:
    """A task's family: its id without a trailing number (`learn-sum-07` -> `learn-sum`),
    so the instances of one generated task read as one curve."""
    return _FAMILY_SUFFIX.sub("", task_id) or task_id


def rewards_by_family(record) -> dict[str, float]:
    """The mean reward of each task family's members in the iteration (failed_infra members,
    None, are left out: they have no reward)."""
    scored: dict[str, list[float]] = {}
    for task, rewards in zip(record.tasks, record.rewards, strict=True):
        scored.setdefault(task_family(task), []).extend(r for r in rewards if r is not None)
    return {family: sum(r) / len(r) for family, r in sorted(scored.items()) if r}


def scalars(record) -> dict[str, float]:
    """Every metric of one iteration record, by its TensorBoard tag (None values left out)."""
    actions = [a for group in record.actions for a in group if a is not None]
    values = {
        "reward/mean": record.mean_reward,
        "reward/heldout": record.heldout_reward,
        **{f"reward/family/{family}": mean for family, mean in rewards_by_family(record).items()},
        "train/loss": record.loss,
        "train/kl": record.kl,
        "train/clip_fraction": record.clip_fraction,
        "train/entropy": record.entropy,
        "train/grad_norm": record.grad_norm,
        "train/lr": record.lr,
        "train/trained_tokens": record.trained_tokens,
        "train/engine_logprob_drift": record.engine_logprob_drift,
        "rollout/response_tokens": record.response_tokens,
        "rollout/actions_per_trajectory": sum(actions) / len(actions) if actions else None,
        "groups/kept": record.groups_kept,
        "groups/dropped": record.groups_dropped,
        "groups/uniform": record.uniform_groups,
        "rollout/infra_retries": record.infra_retries,
        "time/rollout_s": record.rollout_s,
        "time/train_s": record.train_s,
        "time/publish_s": record.publish_s,
        "time/recovery_s": record.recovery_s,
    }
    return {tag: float(value) for tag, value in values.items() if value is not None}


class EventLog:
    """The event files of one run under `logdir/<run id>` (torch's SummaryWriter)."""

    def __init__(self, logdir: Path, run_id: str):
        from torch.utils.tensorboard import SummaryWriter  # import cost: torch, ~2.5 s

        self.directory = Path(logdir) / run_id
        self._writer = SummaryWriter(log_dir=str(self.directory))
        self._written: set[int] = set()

    def write(self, records) -> None:
        """Write the records not written yet, and flush: TensorBoard shows them at once."""
        for record in records:
            if record.iteration in self._written:
                continue
            for tag, value in scalars(record).items():
                self._writer.add_scalar(tag, value, global_step=record.iteration)
            self._written.add(record.iteration)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
