"""A training run's weights as a standard Hugging Face model folder (`belayer model export`).

The trainer writes each iteration's state once, as one safetensors object holding the
weights under their Hugging Face Llama names beside AdamW's state and the RNG
(`belayer.trainer.state`). An export reads the checkpoint an iteration record points at
(its sha256 checked on the way), keeps the weights alone, in fp32 as trained, and writes
them next to the config and tokenizer of the project-built model the run started from:
a folder that vLLM and transformers load like any other Llama checkpoint.

The weights are serialised exactly as the trainer serialises what it publishes, so the
exported `model.safetensors` has the sha256 the iteration's record names as its
`weights_sha256`; an export whose bytes differ is refused, never written.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save
from temporalio.service import RPCError, RPCStatusCode

from belayer.config import BelayerConfig
from belayer.errors import BelayerError
from belayer.model.build import MANIFEST, model_path, staged_folder
from belayer.storage.errors import CorruptObject, ObjectNotFound
from belayer.storage.store import open_store
from belayer.temporal_client import connect
from belayer.trainer.models import TrainerCheckpointRef
from belayer.trainer.state import Checkpoint, decode_checkpoint
from belayer.training import read_iterations, run_progress
from belayer.workflows.training_models import IterationRecord

WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "belayer-export.json"  # which run, iteration and checkpoint the folder holds
_SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}

Progress = Callable[[str], None]


class ExportError(BelayerError):
    """The run, iteration or output folder cannot give an export."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote (also the content of the folder's provenance file)."""

    run_id: str
    iteration: int
    model: str
    weights_version: int
    weights_sha256: str
    checkpoint_key: str
    checkpoint_sha256: str


def export_run(
    config: BelayerConfig,
    run_id: str,
    out: Path,
    *,
    iteration: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Exported:
    """Export run `run_id`'s weights after `iteration` (default: its last recorded one)
    into the folder `out`, looking the run up through Temporal."""

    check_out(out, force)
    record = pick_iteration(run_id, asyncio.run(_run_records(config, run_id)), iteration)
    with open_store(config.storage, encrypted=False) as store:
        return export_checkpoint(
            store, run_id, record.checkpoint, out, cache_dir=config.cache_dir, force=force, progress=progress
        )


def export_checkpoint(
    store,
    run_id: str,
    ref: TrainerCheckpointRef,
    out: Path,
    *,
    cache_dir: Path | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Exported:
    """Write the weights of the trainer checkpoint `ref` of run `run_id` into `out`, with the
    config and tokenizer of the built model it was trained from."""
    check_out(out, force)
    checkpoint = read_checkpoint(store, run_id, ref)
    weights = checkpoint.weights_only()
    model_dir = model_path(checkpoint.model_name, cache_dir, progress)
    check_layout(weights, model_dir, checkpoint.model_name)
    data = serialised_weights(run_id, ref, weights)
    exported = Exported(
        run_id=run_id,
        iteration=ref.iteration,
        model=checkpoint.model_name,
        weights_version=ref.weights_version,
        weights_sha256=ref.weights.sha256,
        checkpoint_key=ref.key,
        checkpoint_sha256=ref.sha256,
    )
    write_model_dir(model_dir, data, exported, out, force)
    return exported


def pick_iteration(run_id: str, records: list[IterationRecord], iteration: int | None) -> IterationRecord:
    """The record of `iteration` (None: the last one), or an error naming those there are."""
    if not records:
        raise ExportError(f"run {run_id!r} has no finished iteration yet: nothing to export")
    if iteration is None:
        return records[-1]
    found = [r for r in records if r.iteration == iteration]
    if not found:
        first, last = records[0].iteration, records[-1].iteration
        raise ExportError(
            f"run {run_id!r} has no iteration {iteration}; its recorded iterations are {first}..{last}"
        )
    return found[0]


def check_out(out: Path, force: bool) -> None:
    """`out` must be new or an empty folder; with `force`, any folder (it is replaced)."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(
            f"--out {out} exists and is not empty; choose another folder, or pass --force "
            "to replace it and everything in it"
        )


def read_checkpoint(store, run_id: str, ref: TrainerCheckpointRef) -> Checkpoint:
    """The checkpoint object, its bytes checked against the sha256 the record names."""
    try:
        checkpoint = decode_checkpoint(ref.key, store.get_bytes(ref.key, expected_sha256=ref.sha256))
    except CorruptObject as exc:
        raise ExportError(
            f"run {run_id!r} iteration {ref.iteration}: the trainer checkpoint {ref.key!r} is "
            f"corrupt, not exported: {exc}"
        ) from None
    except ObjectNotFound:
        raise ExportError(
            f"run {run_id!r} iteration {ref.iteration}: the trainer checkpoint {ref.key!r} is "
            f"missing from bucket {store.cfg.bucket!r}"
        ) from None
    if (checkpoint.run_id, checkpoint.iteration) != (run_id, ref.iteration):
        raise ExportError(
            f"run {run_id!r} iteration {ref.iteration}: {ref.key!r} holds iteration "
            f"{checkpoint.iteration} of run {checkpoint.run_id!r}, not exported"
        )
    return checkpoint


def check_layout(weights: dict, model_dir: Path, model_name: str) -> None:
    """The checkpoint's weights must be the built model's tensors (names, shapes, dtypes):
    the folder's config describes them, and nothing may be cast on the way."""

    with safe_open(str(model_dir / WEIGHTS_FILE), framework="pt") as f:
        built = {
            name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()
        }
    trained = {
        name: (tuple(t.shape), _SAFETENSORS_DTYPES.get(str(t.dtype), str(t.dtype)))
        for name, t in weights.items()
    }
    if trained != built:
        differing = sorted(k for k in trained.keys() | built.keys() if trained.get(k) != built.get(k))
        raise ExportError(
            f"the checkpoint's weights do not fit the built model {model_name!r} ({model_dir}): "
            f"{len(differing)} tensors differ, first {differing[:3]}; was the model rebuilt "
            "with another recipe since the run?"
        )


def serialised_weights(run_id: str, ref: TrainerCheckpointRef, weights: dict) -> bytes:
    """The weights as one safetensors blob, byte for byte what the trainer published for
    this iteration (its sha256 is the record's `weights_sha256`)."""
    data = save({k: v.contiguous() for k, v in weights.items()})
    sha256 = hashlib.sha256(data).hexdigest()
    if sha256 != ref.weights.sha256:
        raise ExportError(
            f"run {run_id!r} iteration {ref.iteration}: the weights in {ref.key!r} have sha256 "
            f"{sha256}, not the {ref.weights.sha256} the record names; not exported"
        )
    return data


def write_model_dir(model_dir: Path, weights: bytes, exported: Exported, out: Path, force: bool) -> None:
    """Stage the folder beside `out` and move it into place whole: an interrupted export
    never leaves a half-written model where a loader would find it."""
    with staged_folder(out) as staging:
        staging.chmod(0o755)  # mkdtemp's folder is private; an export is for other tools to read
        for item in sorted(model_dir.iterdir()):
            if item.is_file() and item.name not in (WEIGHTS_FILE, MANIFEST):
                shutil.copyfile(item, staging / item.name)
        (staging / WEIGHTS_FILE).write_bytes(weights)
        (staging / PROVENANCE_FILE).write_text(json.dumps(asdict(exported), indent=2, sort_keys=True) + "\n")
        check_out(out, force)


async def _run_records(config: BelayerConfig, run_id: str) -> list[IterationRecord]:
    """Every iteration run `run_id` recorded, found through its workflow's `progress` query."""

    client = await connect(config.temporal, config.storage.encryption_key)
    try:
        description = await client.get_workflow_handle(run_id).describe()
        if description.workflow_type != "TrainingWorkflow":
            raise ExportError(f"{run_id!r} is a {description.workflow_type}, not a training run")
        progress = await run_progress(client, run_id)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise ExportError(
                f"no training run {run_id!r} on Temporal at {config.temporal.address} "
                f"(namespace {config.temporal.namespace}); list runs in the web UI "
                "(filter BelayerRun)"
            ) from None
        raise ExportError(
            f"Temporal at {config.temporal.address} could not tell about run {run_id!r}: {exc}"
        ) from None
    return await asyncio.to_thread(read_iterations, config, progress)
