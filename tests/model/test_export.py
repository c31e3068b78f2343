"""`belayer model export`: a real trainer checkpoint in the real object store becomes a
model folder that transformers and vLLM load, with the trainer's own logprobs.

Measured on the tiny model (fp32, CPU, 2 threads) over a 45-token sequence, against
`belayer.trainer.policy`: transformers with its default settings differs from the
trainer's logprobs by at most 4.8e-6 per token, vLLM (CPU, enforce_eager) by at most
6.7e-6; the tolerance leaves room for other CPUs' kernels.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from belayer.export import PROVENANCE_FILE, ExportError, export_checkpoint, export_run, pick_iteration
from belayer.model.build import MANIFEST, model_path
from belayer.rollout.procutil import engine_environment
from belayer.storage.store import open_store
from belayer.temporal_client import TemporalUnreachable
from belayer.trainer.policy import load_policy, token_logprobs
from belayer.trainer.step import Trainer
from belayer.workflows.training_models import IterationRecord
from tests.conftest import delete_all_under, free_port_block
from tests.trainer.conftest import batch, step_args

TOLERANCE = 1e-4  # per token, in nats
TEXT = "Task: write the number in /workspace/input plus 7 to /workspace/output. <bash>echo $(( $(cat /w"


@pytest.fixture(scope="module")
def store(seaweedfs):
    """The session's object store under a key prefix of this module's own."""
    prefix = f"t-{uuid.uuid4().hex[:12]}/"
    cfg = seaweedfs.storage_config.model_copy(update={"key_prefix": prefix})
    with open_store(cfg, encrypted=False) as store:
        yield store
    delete_all_under(cfg, prefix)


@pytest.fixture(scope="module")
def trained(store):
    """One real GRPO step of the tiny model: the run id and the checkpoint it wrote."""
    run_id = f"export-{uuid.uuid4().hex[:8]}"
    result = Trainer(device="cpu").step(store, step_args(run_id, batch(store)))
    return run_id, result.checkpoint


@pytest.fixture(scope="module")
def exported(store, trained, tmp_path_factory) -> Path:
    run_id, ref = trained
    out = tmp_path_factory.mktemp("export") / "model"
    export_checkpoint(store, run_id, ref, out)
    return out


@pytest.fixture(scope="module")
def checkpoint_weights(store, trained) -> dict:
    from belayer.trainer.state import decode_checkpoint

    ref = trained[1]
    return decode_checkpoint(ref.key, store.get_bytes(ref.key)).weights_only()


@pytest.fixture(scope="module")
def tokens(exported) -> list[int]:
    """A fixed sequence, through the exported tokenizer (so its files load too)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(exported)).encode(TEXT)
    assert 30 < len(ids) < 100
    return ids


@pytest.fixture(scope="module")
def trainer_logprobs(checkpoint_weights, tokens) -> torch.Tensor:
    """What the trainer computes for the checkpoint's weights."""
    policy = load_policy(model_path("tiny"), torch.device("cpu"), checkpoint_weights)
    with torch.no_grad():
        return token_logprobs(policy, tokens, temperature=1.0)


def test_the_folder_holds_the_checkpoint_weights_bit_for_bit(exported, trained, checkpoint_weights):
    run_id, ref = trained
    built = model_path("tiny")
    expected_files = {p.name for p in built.iterdir()} - {MANIFEST} | {PROVENANCE_FILE}
    assert {p.name for p in exported.iterdir()} == expected_files
    assert all(
        (exported / name).read_bytes() == (built / name).read_bytes()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json")
    )
    weights = (exported / "model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == ref.weights.sha256, "the record's weights_sha256"
    saved = load_file(str(exported / "model.safetensors"))
    assert saved.keys() == checkpoint_weights.keys()
    assert all(t.dtype == torch.float32 and torch.equal(t, checkpoint_weights[k]) for k, t in saved.items())
    built_weights = load_file(str(built / "model.safetensors"))
    assert any(not torch.equal(t, built_weights[k]) for k, t in saved.items()), (
        "the trained weights, not the built"
    )
    provenance = json.loads((exported / PROVENANCE_FILE).read_text())
    assert provenance == {
        "run_id": run_id,
        "iteration": 0,
        "model": "tiny",
        "weights_version": 2,
        "weights_sha256": ref.weights.sha256,
        "checkpoint_key": ref.key,
        "checkpoint_sha256": ref.sha256,
    }


def test_transformers_loads_it_and_gives_the_trainers_logprobs(exported, tokens, trainer_logprobs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(exported))  # defaults: what a user gets
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        theirs = token_logprobs(model.eval(), tokens, temperature=1.0)
    difference = (theirs - trainer_logprobs).abs().max().item()
    assert difference < TOLERANCE, difference
    built = AutoModelForCausalLM.from_pretrained(str(model_path("tiny")))
    with torch.no_grad():
        untrained = token_logprobs(built.eval(), tokens, temperature=1.0)
    assert (untrained - trainer_logprobs).abs().max().item() > 100 * TOLERANCE, (
        "the step must move the logprobs more than the tolerance, or the comparison proves nothing"
    )


# Runs in its own process: vLLM sets process-wide state (threads, its own environment).
VLLM_PROMPT_LOGPROBS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model_dir, tokens = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=1,
          kv_cache_memory_bytes=16 << 20, seed=0)
(out,) = llm.generate(TokensPrompt(prompt_token_ids=tokens), SamplingParams(max_tokens=1, prompt_logprobs=0),
                      use_tqdm=False)
print(json.dumps([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], tokens[1:])]))
"""


@pytest.mark.usefixtures("tiny_model")
def test_vllm_loads_it_and_gives_the_trainers_logprobs(exported, tokens, trainer_logprobs):
    pytest.importorskip("vllm")
    done = subprocess.run(
        [sys.executable, "-c", VLLM_PROMPT_LOGPROBS, str(exported), json.dumps(tokens)],
        env=os.environ | engine_environment(2),
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.tensor(json.loads(done.stdout.strip().splitlines()[-1]))
    difference = (theirs - trainer_logprobs).abs().max().item()
    assert difference < TOLERANCE, difference


def test_a_corrupt_or_missing_checkpoint_is_refused_naming_run_iteration_and_key(store, trained, tmp_path):
    """The bytes at the key no longer match the sha256 recorded with them (bit rot, a
    partial overwrite): nothing is written."""
    run_id, ref = trained
    damaged_key = f"runs/{run_id}/trainer/damaged.safetensors"
    data = bytearray(store.get_bytes(ref.key))
    data[-1] ^= 0xFF
    metadata = store.client.head_object(Bucket=store.cfg.bucket, Key=store.cfg.key_prefix + ref.key)[
        "Metadata"
    ]
    store.client.put_object(
        Bucket=store.cfg.bucket, Key=store.cfg.key_prefix + damaged_key, Body=bytes(data), Metadata=metadata
    )
    out = tmp_path / "model"
    with pytest.raises(ExportError, match="corrupt") as refused:
        export_checkpoint(store, run_id, ref.model_copy(update={"key": damaged_key}), out)
    assert all(part in str(refused.value) for part in (repr(run_id), "iteration 0", damaged_key))
    with pytest.raises(
        ExportError, match=f"iteration 0: the trainer checkpoint 'runs/{run_id}/gone' is missing"
    ):
        export_checkpoint(store, run_id, ref.model_copy(update={"key": f"runs/{run_id}/gone"}), out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_replaced_only_with_force(store, trained, tmp_path):
    run_id, ref = trained
    out = tmp_path / "model"
    out.mkdir()
    export_checkpoint(store, run_id, ref, out)  # empty: fine
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty.*--force"):
        export_checkpoint(store, run_id, ref, out)
    assert (out / "notes.txt").read_text() == "mine"
    export_checkpoint(store, run_id, ref, out, force=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "no staging folder left behind"


def test_the_iteration_defaults_to_the_last_and_a_missing_one_names_those_there_are(trained):
    records = [IterationRecord.model_construct(iteration=k, checkpoint=trained[1]) for k in range(3)]
    assert pick_iteration("run-a", records, None).iteration == 2
    assert pick_iteration("run-a", records, 1).iteration == 1
    with pytest.raises(
        ExportError, match=r"run 'run-a' has no iteration 5; its recorded iterations are 0\.\.2"
    ):
        pick_iteration("run-a", records, 5)
    with pytest.raises(ExportError, match="no finished iteration"):
        pick_iteration("run-a", [], None)


def test_an_unknown_run_and_an_unreachable_server_are_named(temporal_server, stack_config, tmp_path):
    with pytest.raises(
        ExportError, match=f"no training run 'nope' on Temporal at {stack_config.temporal.address}"
    ):
        export_run(stack_config, "nope", tmp_path / "a")
    (port,) = free_port_block(1, with_grpc=False)
    nowhere = stack_config.model_copy(
        update={"temporal": stack_config.temporal.model_copy(update={"address": f"127.0.0.1:{port}"})}
    )
    with pytest.raises(TemporalUnreachable, match=f"cannot reach Temporal at 127.0.0.1:{port}"):
        export_run(nowhere, "nope", tmp_path / "b")
    assert list(tmp_path.iterdir()) == []
