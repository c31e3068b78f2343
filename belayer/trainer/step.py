"""`Trainer.step`: one iteration of the loop, idempotent and resumable.

The trainer keeps the latest state in memory (run, iteration, checkpoint sha256); a
step whose `base` is that checkpoint continues from memory, any other loads `base` from
the object store (sha256-verified), or the built model when `base` is None. Loading is
exact, so which of the two happened never shows in the result's numbers.

The checkpoint is written before the step returns (the workflow publishes the weights
after), create-if-absent: when it already exists an earlier attempt finished this
iteration, and its recorded result is returned ("already done") without computing.
The in-memory state is forgotten before the optimizer touches it and adopted again
only once its checkpoint is written, so a failed attempt never leaves a half-stepped
state for the retry to continue from.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from belayer.errors import BelayerError
from belayer.model.build import MANIFEST, file_sha256, model_path
from belayer.storage.errors import ObjectConflict
from belayer.storage.store import ObjectRef
from belayer.storage.weights import store_weights
from belayer.trainer.batch import load_samples
from belayer.trainer.models import StartWeightsArgs, TrainerCheckpointRef, TrainStepArgs, TrainStepResult
from belayer.trainer.policy import load_policy, make_deterministic, resolve_device
from belayer.trainer.samples import load_groups
from belayer.trainer.state import (
    Checkpoint,
    TrainerState,
    built_state,
    checkpoint_key,
    configure,
    decode_checkpoint,
    encode_checkpoint,
    platform_of,
    restore,
    weights_key,
)
from belayer.trainer.update import StepStats, update_policy

Events = Callable[[str], None]  # "stepped" (before the checkpoint), "checkpointed" (after)


class TrainRequestError(BelayerError):
    """The step's arguments cannot be served (retrying them cannot help)."""


class Trainer:
    """One process's trainer: at most one step at a time, the latest state in memory."""

    def __init__(self, *, cache_dir: Path | None = None, device: str = "auto"):
        self.cache_dir = cache_dir
        self.device = resolve_device(device)
        self._state: TrainerState | None = None
        self._reference: tuple[tuple[str, str], torch.nn.Module] | None = None  # (model identity, weights)
        self._lock = threading.Lock()

    def step(self, store, args: TrainStepArgs, events: Events | None = None) -> TrainStepResult:
        events = events or (lambda _name: None)
        with self._lock:
            started = time.perf_counter()
            _check(args)
            make_deterministic(args.settings.threads)
            done = self._already_done(store, args)
            if done is not None:
                return done
            state, resumed_from = self._state_for(store, args)
            if args.base_republished:  # the same bytes, served under a new number since a resume
                state.weights_version = args.sampled_version
            _check_version(args, state)
            here = platform_of(self.device)
            _check_platform(args, state, here)
            state.platform = here  # what computes the step's new state
            self._state = None  # half-stepped until its checkpoint is written
            samples, unreadable = load_groups(store, [*args.samples, *load_samples(store, args.batch)])
            configure(state.optimizer, args.settings, args.iteration)
            stats = update_policy(
                state.model,
                state.optimizer,
                self._reference_for(args),
                state.weights_version,
                samples,
                args.settings,
                args.minibatch_seed,
            )
            stats = replace(stats, skipped=unreadable + stats.skipped)
            events("stepped")
            ref, stats = self._write(store, state, args, stats)
            events("checkpointed")
            return _result(ref, stats, resumed_from, time.perf_counter() - started)

    def _state_for(self, store, args: TrainStepArgs) -> tuple[TrainerState, str]:
        held = self._state
        if (
            held is not None
            and held.run_id == args.run_id
            and held.checkpoint == args.base
            and held.model_name == args.model
        ):
            return held, "memory"
        if args.base is None:
            return built_state(
                args.run_id,
                args.model,
                self._model_dir(args),
                self.device,
                args.settings,
                args.sampled_version,
            ), "built model"
        data = store.get_bytes(args.base.key, expected_sha256=args.base.sha256)
        checkpoint = decode_checkpoint(args.base.key, data)
        _check_base(args, checkpoint)
        return restore(checkpoint, self._model_dir(args), self.device, args.base), "checkpoint"

    def _write(
        self, store, state: TrainerState, args: TrainStepArgs, stats: StepStats
    ) -> tuple[TrainerCheckpointRef, StepStats]:
        """Weights, then the checkpoint (create-if-absent); an earlier attempt's checkpoint
        wins, and its weights are put back in case they differ from ours."""
        version = new_version(args)
        weights = store_weights(store, weights_key(args.run_id, version), state.model.state_dict())
        base_sha = args.base.sha256 if args.base else ""
        data = encode_checkpoint(state, args.iteration, version, base_sha, args.settings, stats, weights)
        key = checkpoint_key(args.run_id, args.iteration)
        try:
            stored = store.put_bytes(key, data, if_absent=True)
        except ObjectConflict:
            return self._adopt(store, args)
        state.weights_version = version
        state.checkpoint = TrainerCheckpointRef(
            iteration=args.iteration, key=key, sha256=stored.sha256, weights=weights, weights_version=version
        )
        self._state = state
        return state.checkpoint, stats

    def _already_done(self, store, args: TrainStepArgs) -> TrainStepResult | None:
        if not store.exists(checkpoint_key(args.run_id, args.iteration)):
            return None
        ref, stats = self._adopt(store, args)
        return _result(ref, stats, "already done", 0.0)

    def _adopt(self, store, args: TrainStepArgs) -> tuple[TrainerCheckpointRef, StepStats]:
        """Take the stored checkpoint of `args.iteration` as this trainer's state, making
        sure its weights object is there and is the one it records."""
        key = checkpoint_key(args.run_id, args.iteration)
        data = store.get_bytes(key)
        checkpoint = decode_checkpoint(key, data)
        _check_done(args, checkpoint)
        if not _weights_present(store, checkpoint):
            store_weights(store, checkpoint.weights.key, checkpoint.weights_only())
        ref = TrainerCheckpointRef(
            iteration=checkpoint.iteration,
            key=key,
            sha256=hashlib.sha256(data).hexdigest(),
            weights=checkpoint.weights,
            weights_version=checkpoint.weights_version,
        )
        self._state = restore(checkpoint, self._model_dir(args), self.device, ref)
        return ref, checkpoint.stats

    def _reference_for(self, args: TrainStepArgs) -> torch.nn.Module | None:
        """The frozen initial weights of the run's model, only while the KL term is on:
        loaded once per model identity (its name and its manifest's hash), since one
        trainer process serves runs of different models, and a model rebuilt under the
        same name is another model."""
        if args.settings.kl_coef == 0:
            return None
        model_dir = self._model_dir(args)
        identity = (args.model, file_sha256(model_dir / MANIFEST))
        if self._reference is None or self._reference[0] != identity:
            self._reference = (identity, load_policy(model_dir, self.device).requires_grad_(False))
        return self._reference[1]

    def _model_dir(self, args: TrainStepArgs | StartWeightsArgs) -> Path:
        return model_path(args.model, self.cache_dir)

    def start_weights(self, store, args: StartWeightsArgs) -> ObjectRef:
        """The run's start as this trainer loads it (the built model, as iteration 0 steps
        from it), stored as weights `args.version`: what every node serves before the first
        rollout, so the first iteration samples exactly the bytes it trains on, whatever the
        nodes were built from. A retry stores the same bytes again, which the store takes as
        its own earlier write; other weights at that version (a run id used again, whose earlier
        attempt trained that version) are refused, never served as this run's start."""
        with self._lock:
            key = weights_key(args.run_id, args.version)
            model = load_policy(self._model_dir(args), self.device)
            try:
                return store_weights(store, key, model.state_dict(), if_absent=True)
            except ObjectConflict:
                raise TrainRequestError(
                    f"run {args.run_id}: weights v{args.version} are already stored and are not the "
                    f"{args.model} the run starts from (an earlier attempt of this run id trained them): "
                    "start the run under another --run-id"
                ) from None


def _check(args: TrainStepArgs) -> None:
    if args.base is None and args.iteration != 0:
        raise TrainRequestError(
            f"iteration {args.iteration} needs a base checkpoint (only iteration 0 "
            "starts from the built model)"
        )
    if args.base is not None and args.base.iteration != args.iteration - 1:
        raise TrainRequestError(
            f"iteration {args.iteration} must step from iteration "
            f"{args.iteration - 1}'s checkpoint, not iteration {args.base.iteration}'s"
        )


def new_version(args: TrainStepArgs) -> int:
    """The version the step's weights are published as."""
    return args.weights_version or args.sampled_version + 1


def _check_version(args: TrainStepArgs, state: TrainerState) -> None:
    """The samples must have been drawn by the weights the trainer steps from (the loop
    publishes `base` before it rolls out), and versions only grow."""
    if state.weights_version != args.sampled_version:
        raise TrainRequestError(
            f"the samples were drawn with weights version {args.sampled_version}, but "
            f"the trainer's state for iteration {args.iteration} is version {state.weights_version}"
        )
    if new_version(args) <= args.sampled_version:
        raise TrainRequestError(
            f"weights_version {args.weights_version} must be above sampled_version "
            f"{args.sampled_version}: versions only grow"
        )


def _check_platform(args: TrainStepArgs, state: TrainerState, here: dict[str, str]) -> None:
    """A run's steps are bit-identical only on one platform: a state another device, torch
    or CPU ISA computed is not stepped here (the run would silently become another run)."""
    if state.platform is not None and state.platform != here:
        differ = ", ".join(f"{k} {state.platform.get(k)!r} there, {here.get(k)!r} here"
                           for k in sorted(here.keys() | state.platform.keys()) if state.platform.get(k) != here.get(k))  # fmt: skip
        raise TrainRequestError(
            f"run {args.run_id!r} was trained on another platform ({differ}): its next step here would not "
            "be the one it would have taken there; resume it on a trainer like the one that wrote "
            f"iteration {state.checkpoint.iteration if state.checkpoint else 0}'s checkpoint"
        )


def _check_base(args: TrainStepArgs, checkpoint: Checkpoint) -> None:
    if checkpoint.model_name != args.model or checkpoint.iteration != args.base.iteration:
        raise TrainRequestError(
            f"{args.base.key!r} holds iteration {checkpoint.iteration} of model {checkpoint.model_name!r}, "
            f"not iteration {args.base.iteration} of {args.model!r}"
        )


def _check_done(args: TrainStepArgs, checkpoint: Checkpoint) -> None:
    """A finished iteration answers a retry only if the retry asks for the same step."""
    base_sha = args.base.sha256 if args.base else ""
    if (checkpoint.run_id, checkpoint.model_name, checkpoint.base_sha256) != (
        args.run_id,
        args.model,
        base_sha,
    ):
        raise TrainRequestError(
            f"iteration {args.iteration} of run {args.run_id!r} was already trained from another base "
            f"({checkpoint.base_sha256 or 'the built model'}, model {checkpoint.model_name!r}); a run's "
            "iterations are written once"
        )


def _weights_present(store, checkpoint: Checkpoint) -> bool:
    return (
        store.exists(checkpoint.weights.key)
        and store.head(checkpoint.weights.key).sha256 == checkpoint.weights.sha256
    )


def _result(
    ref: TrainerCheckpointRef, stats: StepStats, resumed_from: str, train_s: float
) -> TrainStepResult:
    return TrainStepResult(
        checkpoint=ref,
        weights_sha256=ref.weights.sha256,
        resumed_from=resumed_from,
        train_s=train_s,
        **{**stats.__dict__},
    )
