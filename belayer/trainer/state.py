"""The trainer's state and its write-once checkpoints.

A checkpoint is one safetensors object at `runs/<run>/trainer/iteration-<k>.safetensors`:
the weights under their HF names, AdamW's `exp_avg`, `exp_avg_sq` and `step` per
parameter (`optim/<name>/<field>`), and torch's CPU RNG state (`rng/torch`); its
safetensors metadata holds iteration, weights version, run, model, base checkpoint,
settings, the step's recorded result and the platform that computed it (device, torch
version, CPU ISA), so a retry of a finished iteration answers exactly what the first
attempt did, and a resume elsewhere knows it would not step the same. Timings are not recorded: the bytes of a checkpoint
depend on the computation alone, so a run with faults writes the same checkpoints, bit
for bit, as the run without.

Every tensor round-trips exactly, so a state loaded from a checkpoint steps to the same
bytes as the state that stayed in memory. The step draws nothing random today; the RNG
state is kept so that a future random draw would resume exactly too.

Versions are the ones the nodes serve: the workflow names the version the samples were
drawn with and the one the new weights are published as (`TrainStepArgs`); a run that
starts on nodes at version 1 publishes iteration k as version k + 2.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, save

from belayer.storage.errors import CorruptObject
from belayer.storage.store import ObjectRef
from belayer.trainer.models import (  # noqa: F401 (the keys: re-exported)
    SkippedGroup,
    TrainerCheckpointRef,
    TrainerSettings,
    checkpoint_key,
    weights_key,
)
from belayer.trainer.policy import load_policy
from belayer.trainer.update import StepStats

FORMAT = "belayer-trainer-checkpoint/1"
_OPTIM = "optim/"
_RNG = "rng/torch"
_ADAM_FIELDS = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class TrainerState:
    """The model being trained, its optimizer, and where that state is recorded."""

    run_id: str
    model_name: str
    model: torch.nn.Module
    optimizer: torch.optim.AdamW
    weights_version: int  # the version the model's weights are (and sampled with)
    checkpoint: TrainerCheckpointRef | None  # None: the built model, not yet stepped
    platform: dict[str, str] | None = None  # what computed the state; None: unknown (an older checkpoint)


@dataclass(frozen=True)
class Checkpoint:
    """A decoded checkpoint object."""

    tensors: dict[str, torch.Tensor]
    run_id: str
    model_name: str
    iteration: int
    weights_version: int
    base_sha256: str  # "" when stepped from the built model
    settings: TrainerSettings
    stats: StepStats
    weights: ObjectRef
    platform: dict[str, str] | None  # None: written before platforms were recorded

    def weights_only(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.tensors.items() if not k.startswith((_OPTIM, _RNG))}


def new_optimizer(model: torch.nn.Module, settings: TrainerSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)


def configure(optimizer: torch.optim.AdamW, settings: TrainerSettings, iteration: int) -> None:
    """Apply iteration `iteration`'s settings (the same numbers whether the optimizer is new,
    kept or restored: the learning rate is a function of the iteration alone)."""
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = step_lr(settings, iteration), settings.weight_decay


def step_lr(settings: TrainerSettings, iteration: int) -> float:
    """The learning rate of `iteration`: constant, or decaying linearly to 0."""
    if settings.lr_decay_iterations == 0:
        return settings.lr
    return settings.lr * max(0.0, 1.0 - iteration / settings.lr_decay_iterations)


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict on the CPU, contiguous, under HF names (what is published)."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def encode_checkpoint(
    state: TrainerState,
    iteration: int,
    version: int,
    base_sha256: str,
    settings: TrainerSettings,
    stats: StepStats,
    weights: ObjectRef,
) -> bytes:
    tensors = weights_of(state.model)
    tensors.update(_optimizer_tensors(state.model, state.optimizer))
    tensors[_RNG] = torch.get_rng_state()
    metadata = {
        "format": FORMAT,
        "run_id": state.run_id,
        "model": state.model_name,
        "iteration": str(iteration),
        "weights_version": str(version),
        "base_sha256": base_sha256,
        "settings": settings.model_dump_json(),
        "result": json.dumps(_stats_dict(stats), sort_keys=True),
        "weights": weights.model_dump_json(),
        "platform": json.dumps(state.platform, sort_keys=True),
    }
    return save(tensors, metadata=metadata)


def decode_checkpoint(key: str, data: bytes) -> Checkpoint:
    """`CorruptObject` when `data` is not a trainer checkpoint."""
    try:
        meta = _safetensors_metadata(data)
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r} is not {FORMAT!r}")
        return Checkpoint(
            tensors=load(data),
            run_id=meta["run_id"],
            model_name=meta["model"],
            iteration=int(meta["iteration"]),
            weights_version=int(meta["weights_version"]),
            base_sha256=meta["base_sha256"],
            settings=TrainerSettings.model_validate_json(meta["settings"]),
            stats=_stats_of(json.loads(meta["result"])),
            weights=ObjectRef.model_validate_json(meta["weights"]),
            platform=json.loads(meta["platform"]) if "platform" in meta else None,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptObject(f"{key!r} is not a trainer checkpoint: {exc}") from None


def restore(
    checkpoint: Checkpoint, model_dir: Path, device: torch.device, ref: TrainerCheckpointRef
) -> TrainerState:
    """The state `checkpoint` records, bit for bit (weights, AdamW state, RNG)."""
    model = load_policy(model_dir, device, checkpoint.weights_only())
    optimizer = new_optimizer(model, checkpoint.settings)
    for name, param in model.named_parameters():
        if f"{_OPTIM}{name}/step" in checkpoint.tensors:
            optimizer.state[param] = {
                "step": checkpoint.tensors[f"{_OPTIM}{name}/step"].clone(),  # AdamW keeps it on the CPU
                "exp_avg": checkpoint.tensors[f"{_OPTIM}{name}/exp_avg"].to(device),
                "exp_avg_sq": checkpoint.tensors[f"{_OPTIM}{name}/exp_avg_sq"].to(device),
            }
    torch.set_rng_state(checkpoint.tensors[_RNG])
    return TrainerState(
        checkpoint.run_id, checkpoint.model_name, model, optimizer, checkpoint.weights_version, ref,
        checkpoint.platform,
    )  # fmt: skip


def built_state(
    run_id: str,
    model_name: str,
    model_dir: Path,
    device: torch.device,
    settings: TrainerSettings,
    version: int,
) -> TrainerState:
    """The run's start: the built model (published as `version`), a fresh AdamW."""
    model = load_policy(model_dir, device)
    return TrainerState(
        run_id, model_name, model, new_optimizer(model, settings), version, None, platform_of(device)
    )


def platform_of(device: torch.device) -> dict[str, str]:
    """What a step's numbers depend on besides its inputs: the device (and its model), the
    torch version, the CPU's vector ISA torch dispatches to."""
    return {
        "device": f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
    }


def _optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.AdamW) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if state:
            for field in _ADAM_FIELDS:
                out[f"{_OPTIM}{name}/{field}"] = state[field].detach().cpu().contiguous()
    return out


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob (an 8-byte little-endian header length, then
    the JSON header)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (size,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


def _stats_dict(stats: StepStats) -> dict:
    return {**stats.__dict__, "skipped": [s.model_dump() for s in stats.skipped]}


def _stats_of(recorded: dict) -> StepStats:
    return StepStats(**{**recorded, "skipped": [SkippedGroup.model_validate(s) for s in recorded["skipped"]]})
