"""What crosses Temporal between the training workflow and the trainer: settings,
pointers to the trajectories to learn from, and pointers to the checkpoint a step wrote.

Never token arrays, logprobs or tensors: a sample is a token-log `PrefixRef` (the trainer
reads tokens, loss mask, versions and engine logprobs from the object store itself) and
a checkpoint is an object key with its sha256.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from belayer.storage.store import ObjectRef
from belayer.storage.tokenlog import PrefixRef
from belayer.trainer.algorithms import ALGORITHMS, DEFAULT, algorithm


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainerSettings(_Model):
    """The objective (an algorithm) and its optimizer; fixed for a run (a checkpoint records them)."""

    lr: float = Field(1e-4, ge=0, description="AdamW learning rate; 0 leaves the weights as they are.")
    lr_decay_iterations: int = Field(
        0,
        ge=0,
        description="Decay the learning rate linearly to 0 over this many iterations (iteration k "
        "steps with lr * (1 - k / this)); 0 keeps it constant.",
    )
    clip_eps: float = Field(0.2, gt=0, le=10, description="PPO clip range of the importance ratio.")
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the KL to the initial weights (k3 estimator); 0 is off."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this global norm.")
    minibatches: int = Field(
        8,
        ge=1,
        le=64,
        description="Optimizer steps per iteration, each on a slice of the batch; "
        "after the first, the importance ratio against the sampling policy is not 1 and clipping acts.",
    )
    temperature: float = Field(
        1.0, gt=0, le=5, description="The sampling temperature: logprobs are taken under logits / T."
    )
    threads: int = Field(
        2,
        ge=1,
        le=256,
        description="torch CPU threads; fixed, because the summation order (and so the "
        "last bits of every result) depends on it.",
    )
    algorithm: str = Field(
        DEFAULT,
        description="How group rewards become advantages (in the training workflow) and what loss "
        f"the trainer takes: one of {', '.join(sorted(ALGORITHMS))} (belayer/trainer/algorithms/).",
    )

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, name: str) -> str:
        return algorithm(name).name


class RolloutRef(_Model):
    """One member of a group after Belayer's own retries, by reference: how it ended and a
    pointer to its token log. Both consumers of rollouts read it as the same `Rollout`
    (belayer/trainer/rollout.py): Belayer's own trainer, through the `TrainSample` that
    carries it, and a trainer of yours, through the rollout API."""

    trajectory_id: str = Field(description="The attempt whose result counts (the last one).")
    status: Literal["completed", "failed_policy", "failed_infra"]
    reward: float | None
    attempts: int
    reason: str = ""
    context: PrefixRef | None = Field(
        None, description="The trajectory's token log (None when failed_infra)."
    )
    recovery_s: float = Field(0.0, description="Time its recoveries lost, over all attempts.")
    task: str = Field("", description="The task's id.")
    member: int = Field(0, ge=0, description="Its place in the group.")
    turns: int = Field(0, ge=0, description="Actions the attempt that counts ran in its sandbox.")
    recoveries: int = Field(0, ge=0, description="Sandbox recoveries over all attempts.")
    tokens_after_recovery: int = Field(
        0,
        ge=0,
        description="The attempt that counts: tokens generated after an engine recovery (TrajectoryResult).",
    )
    recovered_tokens_differ: bool = Field(
        False, description="The attempt that counts: a recovered turn's replay drew other tokens (the flag)."
    )


class TrainSample(_Model):
    """One trajectory to learn from: its final context and the advantage of its group."""

    trajectory_id: str
    group: str = Field(description="Members of one group share it (advantages are relative within a group).")
    context: PrefixRef = Field(description="The trajectory's whole token log (tokens, marks, generations).")
    advantage: float = Field(
        description="The algorithm's advantage for this member of its group, applied to every model token."
    )
    rollout: RolloutRef | None = Field(
        None,
        description="The member it is (samples from before it: its `context` alone), read as a `Rollout`.",
    )


class SamplesRef(_Model):
    """A part of a train step's batch (belayer/trainer/batch.py): the samples stored at
    `key`, whose JSON has sha256 `sha256`."""

    key: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    count: int = Field(ge=0)


def checkpoint_key(run_id: str, iteration: int) -> str:
    return f"runs/{run_id}/trainer/iteration-{iteration:06d}.safetensors"


def weights_key(run_id: str, version: int) -> str:
    return f"runs/{run_id}/weights/v{version}.safetensors"


class TrainerCheckpointRef(_Model):
    """A trainer state written once: weights, AdamW state, RNG, iteration."""

    iteration: int = Field(ge=0, description="The iteration whose optimizer step produced this state.")
    key: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    weights: ObjectRef = Field(
        description="The weights alone (HF names), what rollout.publish_weights takes."
    )
    weights_version: int = Field(ge=2, description="The version these weights are published as.")


class StartWeightsArgs(_Model):
    """The weights a run starts from, as the trainer holds them, to publish as `version`."""

    run_id: str = Field(min_length=1, max_length=120)
    model: str = Field(description="The project-built model the run starts from (rollout.model).")
    version: int = Field(ge=2, description="The version every node will serve them as.")


class TrainStepArgs(_Model):
    run_id: str = Field(min_length=1, max_length=120)
    iteration: int = Field(ge=0)
    model: str = Field(description="The project-built model the run starts from (rollout.model).")
    base: TrainerCheckpointRef | None = Field(
        None, description="The state to step from; None: the built model (weights version 1)."
    )
    samples: list[TrainSample] = Field(
        default_factory=list, description="The samples inline (runs from before `batch`); a step takes both."
    )
    batch: list[SamplesRef] = Field(
        default_factory=list, description="The samples by reference, in parts (belayer/trainer/batch.py)."
    )
    settings: TrainerSettings = TrainerSettings()
    sampled_version: int = Field(
        1,
        ge=1,
        description="The weights version the nodes served while the samples were generated: the "
        "version of `base` as published (the run may have started above 1).",
    )
    weights_version: int | None = Field(
        None, ge=2, description="The version the new weights are published as (default sampled_version + 1)."
    )
    base_republished: bool = Field(
        False,
        description="The nodes serve `base`'s weights under `sampled_version`, not the version they were "
        "first published as (a resumed run publishes its last checkpoint again, as a new version).",
    )
    minibatch_seed: int = Field(
        0,
        ge=0,
        description="Seeds the shuffle of the batch into minibatches (the workflow derives it from the run's "
        "seed and the iteration, so a retried or resumed step shuffles alike).",
    )


class SkippedGroup(_Model):
    group: str
    reason: str


class TrainStepResult(_Model):
    checkpoint: TrainerCheckpointRef
    weights_sha256: str = Field(description="sha256 of the published weights object.")
    loss: float = Field(description="Mean over the minibatches that stepped of their loss (0: none did).")
    kl: float = Field(
        description="Mean k3 estimate of the KL to the initial weights per trained token; 0 when kl_coef is 0."
    )
    clip_fraction: float = Field(
        description="Share of model tokens where the clip decided the loss (TRL's clip_ratio): ratio below "
        "1 - clip_eps with a negative advantage, or above 1 + clip_eps with a positive one."
    )
    trained_tokens: int = Field(description="Model-generated tokens the loss covered.")
    samples: int
    skipped: list[SkippedGroup] = Field(
        default_factory=list, description="Groups left out whole (e.g. sampled by another weights version)."
    )
    engine_logprob_drift: float | None = Field(
        None,
        description="Largest |engine logprob - trainer logprob| over the sampled tokens: how far "
        "the engines' numerics are from the trainer's (reported, not used by the loss).",
    )
    entropy: float | None = Field(
        None, description="Mean over the trained tokens of the sampling policy's entropy at each."
    )
    grad_norm: float | None = Field(
        None, description="Mean over the minibatches that stepped of the gradient norm, before clipping."
    )
    lr: float | None = Field(None, description="The step's learning rate, after decay.")
    response_tokens: float | None = Field(None, description="Model-generated tokens per trained trajectory.")
    resumed_from: Literal["memory", "checkpoint", "built model", "already done"]
    train_s: float = Field(description="Seconds of this attempt (0 when already done).")
