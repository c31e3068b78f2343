"""`belayer train` end to end on a private `belayer up` stack: Temporal, SeaweedFS, podman
sandboxes, a real vLLM rollout node, the real torch trainer worker, all as a user runs them.

The acceptance property of the training loop: with fixed seeds, a run with a real fault of
every kind injected (`--chaos`) has exactly the per-iteration rewards and weights hashes,
and the final weights, of the same run without faults.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from belayer.report.tensorboard import task_family
from belayer.trainer.models import weights_key
from tests.test_stack import BELAYER, belayer
from tests.training.conftest import MODEL
from tests.training.divergence import assert_same_result_or_a_near_tie

ROOT = Path(__file__).parents[2]

# Every fault the chaos suite knows, plus the trainer's death, over the first three
# iterations. Faults land one at a time, each after the previous one's recovery, so the
# fourth iteration (planned without faults) leaves room for those the recoveries pushed on;
# Temporal's, its worker's and S3's may also land on a train step.
# The engine's crash and hang find a learn task's trajectory at its first generation, before
# any action (the others, one past its first action).
EVERY_FAULT = ",".join(
    [
        "engine-crash@first-generation=0",
        "sandbox-crash@iteration=0",
        "trainer-crash@iteration=0",
        "owner-crash@iteration=1",
        "engine-hang@first-generation=1",
        "s3-outage@iteration=1",
        "temporal-restart@iteration=1",
        "node-crash@iteration=2",
        "sandbox-host-crash@iteration=2",
        "temporal-worker-crash@iteration=2",
    ]
)


# A trace task runs long enough for a fault to find a trajectory mid-way; its groups all
# score the same. The learn task gives the gradient: the warm-started model solves it
# some of the time, so its groups' rewards differ.
TRACE_TASKS = [
    {
        "id": "trace-pass",
        "setup": ["mkdir -p /workspace/t"],
        "check": "test $(wc -l < /workspace/t/log) = 4",
        "turns": [
            {"think_tokens": 24, "bash": f"echo {i} >> /workspace/t/log && wc -l < /workspace/t/log"}
            for i in range(4)
        ],
    }
]
TASKS = len(TRACE_TASKS) + 1  # and a learn task: every task, every iteration
ITERATIONS = 4
TRAIN_ARGS = [
    "--iterations",
    str(ITERATIONS),
    "--group-size",
    "2",
    "--tasks-per-iteration",
    str(TASKS),
    "--seed",
    "5",
    "--lr",
    "1e-4",
]


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    learn = yaml.safe_load((ROOT / "examples/workloads/learn.yaml").read_text())["tasks"]
    path = tmp_path_factory.mktemp("workload") / "mixed.yaml"
    path.write_text(yaml.safe_dump({"tasks": TRACE_TASKS + learn[:1]}))
    return path


def train(env, *args) -> dict:
    return json.loads(belayer(env, "train", *args, "--json", timeout=1500).stdout)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tensorboard")


@pytest.fixture(scope="module")
def calm(stack, workload, logdir) -> dict:
    """The run without faults, which the other tests look at; its metrics go to `logdir`."""
    return train(stack[1], str(workload), *TRAIN_ARGS, "--logdir", str(logdir))


def test_a_run_trains_publishes_and_is_followed(stack, calm, logdir, tmp_path):
    config, env = stack
    iterations = calm["iterations"]
    assert [i["iteration"] for i in iterations] == list(range(ITERATIONS))
    assert all(
        i["groups_kept"] == TASKS and i["groups_dropped"] == 0 and i["infra_retries"] == 0 for i in iterations
    )
    assert all(r in (0.0, 1.0) for i in iterations for group in i["rewards"] for r in group)
    versions = [i["weights_version"] for i in iterations]
    assert versions == list(range(versions[0], versions[0] + ITERATIONS))
    assert calm["final_weights_sha256"] == iterations[-1]["weights_sha256"]
    # the trace task's trajectories run its four actions; the figures count every trajectory's
    for i in iterations:
        assert i["actions"][i["tasks"].index("trace-pass")] == [4, 4], i["actions"]
        counted = [a for group in i["actions"] for a in group]
        assert i["mean_actions_per_trajectory"] == pytest.approx(sum(counted) / len(counted))
    every = [a for i in iterations for group in i["actions"] for a in group]
    assert calm["mean_actions_per_trajectory"] == pytest.approx(sum(every) / len(every))
    # fp32 engines and trainer score the sampled tokens alike (a step trains on every iteration)
    assert all(i["engine_logprob_drift"] is not None and i["engine_logprob_drift"] < 1e-3 for i in iterations)
    # every task here has a setup to share: each group's two members are forks of one sandbox,
    # and later iterations fork the first iteration's set-up checkpoint again (--reuse-setup)
    groups = [(i["iteration"], g) for i in iterations for g in i["group_sandboxes"]]
    assert len(groups) == ITERATIONS * TASKS and all(g["forked"] == 2 for _, g in groups), groups
    assert all(str(g["reused_from"]).endswith(f"-i00000-{g['task']}") for n, g in groups if n > 0), groups
    learned = [any(len(set(group)) > 1 for group in i["rewards"]) for i in iterations]
    assert any(learned), "no group with differing rewards: pick another --seed for this test"
    previous = [built_weights_sha256(), *(i["weights_sha256"] for i in iterations)]
    for n, taught in enumerate(learned):
        if taught:
            assert previous[n + 1] != previous[n], f"iteration {n} had a group to learn from"

    # the numbers people read in TensorBoard: in --json, and in event files as the run went
    assert all(i["entropy"] > 0 and i["grad_norm"] >= 0 and i["response_tokens"] > 0 for i in iterations)
    # a gradient exactly where a group's rewards differed (all-equal groups have no advantage)
    assert [i["grad_norm"] > 0 for i in iterations] == [
        any(len(set(g)) > 1 for g in i["rewards"]) for i in iterations
    ]
    assert [i["lr"] for i in iterations] == sorted(
        (i["lr"] for i in iterations), reverse=True
    )  # linear decay
    for i in iterations:
        trace = i["rewards"][i["tasks"].index("trace-pass")]
        assert i["rewards_by_family"]["trace-pass"] == pytest.approx(sum(trace) / len(trace))
        assert set(i["rewards_by_family"]) == {task_family(t) for t in i["tasks"]}
    events = EventAccumulator(str(logdir / calm["run_id"]))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [
        (i["iteration"], pytest.approx(i["mean_reward"])) for i in iterations
    ]
    assert [e.value for e in events.Scalars("train/entropy")] == [
        pytest.approx(i["entropy"]) for i in iterations
    ]

    status = belayer(env, "train", "status", calm["run_id"], "--json")
    assert json.loads(status.stdout)["iterations"] == iterations
    roles = json.loads(
        (config.state_dir / "run" / f"rollout-{env['BELAYER_ROLLOUT__NODE_ID']}.roles.json").read_text()
    )
    assert roles["weights_version"] == versions[-1], "the node serves the last published version"
    assert asyncio.run(_children(config, calm["run_id"])) == ITERATIONS * TASKS * 2

    exported = tmp_path / "exported"
    belayer(env, "model", "export", calm["run_id"], "--out", str(exported))
    weights = exported / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == iterations[-1]["weights_sha256"]
    assert same_tensors(
        load_file(str(weights)), checkpoint_weights(config, calm["run_id"], iteration=ITERATIONS - 1)
    )


def test_faults_of_every_kind_change_nothing_in_the_result(stack, workload, calm):
    stormy = train(stack[1], str(workload), *TRAIN_ARGS, "--chaos", EVERY_FAULT)
    missed = [
        f"{f['kind']}: {f['recovered_by']}"
        for f in stormy["faults"]
        if str(f["recovered_by"]).startswith("not injected")
    ]
    injected = {f["kind"] for f in stormy["faults"]} - {m.split(":")[0] for m in missed}
    assert injected == {p.split("@")[0] for p in EVERY_FAULT.split(",")}, (
        missed,
        [(f["kind"], f["at"], f["recovery_s"]) for f in stormy["faults"]],
    )

    flip = assert_same_result_or_a_near_tie(stack[0], calm, stormy, seed=5, model=MODEL)
    if flip is None:
        # Turns the engine's crash and hang interrupted were replayed: none drew other tokens.
        assert [i["recovered_tokens_differ"] for i in stormy["iterations"]] == [[]] * ITERATIONS
    else:
        warnings.warn(f"the faulted run parted from the calm one at a near-tie: {flip}", stacklevel=1)
    assert [i["tokens_after_recovery"] for i in calm["iterations"]] == [0] * ITERATIONS


# A second seed: other tasks' samples, other groups to learn from, faults finding other
# trajectories. The faults that touch the numbers (a re-prefill after the engine's death or
# hang, the trainer's restart from its checkpoint) and a sandbox's restore, over 2 iterations.
OTHER_SEED_FAULTS = "engine-crash@first-generation=0,trainer-crash@iteration=0,engine-hang@first-generation=1,sandbox-crash@iteration=1"


def test_faults_change_nothing_with_a_second_seed(stack, workload):
    args = [str(workload), *TRAIN_ARGS, "--seed", "6", "--iterations", "2"]  # the last --seed counts
    calm, stormy = train(stack[1], *args), train(stack[1], *args, "--chaos", OTHER_SEED_FAULTS)
    assert not [f for f in stormy["faults"] if str(f["recovered_by"]).startswith("not injected")], stormy[
        "faults"
    ]
    assert len(stormy["faults"]) == len(OTHER_SEED_FAULTS.split(","))
    flip = assert_same_result_or_a_near_tie(stack[0], calm, stormy, seed=6, model=MODEL)
    if flip is not None:
        warnings.warn(f"the faulted run parted from the calm one at a near-tie: {flip}", stacklevel=1)


def test_a_terminated_run_resumes_and_ends_as_if_it_had_not_stopped(stack, workload, calm):
    """`belayer train resume`: the run stopped from Temporal while it published an
    iteration's weights (trained and checkpointed, not recorded), so the resume removes that
    checkpoint, serves the last recorded one's weights again and runs the iteration anew.
    The run keeps the last checkpoint and every third (`--keep-last 1 --keep-every 3`),
    which changes nothing in its numbers, through the resume too."""
    config, env = stack
    run_id = f"resumed-{uuid.uuid4().hex[:6]}"
    retention = ["--keep-last", "1", "--keep-every", "3"]
    first = subprocess.Popen(
        [*BELAYER, "train", str(workload), *TRAIN_ARGS, *retention, "--run-id", run_id, "--json"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        stopped_in = asyncio.run(_terminate_while_publishing(config, run_id))
    finally:
        first.wait(timeout=120)
    refused = belayer(env, "train", "resume", f"{run_id}-unknown", check=False)
    assert refused.returncode != 0 and "no training run" in refused.stderr, refused.stderr
    resumed = train(env, "resume", run_id)
    assert resumed["status"] == "completed"
    assert [(i["rewards"], i["weights_sha256"]) for i in resumed["iterations"]] == [
        (i["rewards"], i["weights_sha256"]) for i in calm["iterations"]
    ]
    assert resumed["final_weights_sha256"] == calm["final_weights_sha256"]
    versions = [i["weights_version"] for i in resumed["iterations"]]
    assert versions[stopped_in] > versions[stopped_in - 1] + 1, (
        "the checkpoint was served again, as a new version"
    )
    again = belayer(env, "train", "resume", run_id, check=False)
    assert again.returncode != 0 and "completed all its" in again.stderr, again.stderr

    storage = json.loads(belayer(env, "train", "status", run_id, "--json").stdout)["storage"]
    assert storage["checkpoints"] == [2, 3], storage  # the last, and iteration 2 (every third)
    present = set(_keys(config, f"runs/{run_id}/weights/"))
    weights = [weights_key(run_id, version) for version in versions]
    assert weights[0] not in present and weights[1] not in present, present
    assert {weights[2], weights[3]} <= present
    assert storage["objects"] >= len(present) + 2 and storage["bytes"] > 0


def _keys(config, prefix: str) -> list[str]:
    from belayer.storage.store import open_store

    with open_store(config.storage, encrypted=False) as store:
        return list(store.list(prefix))


async def _terminate_while_publishing(config, run_id: str) -> int:
    """Terminate the run once an iteration past the first is publishing; that iteration."""
    from temporalio.client import WorkflowExecutionStatus

    from belayer.temporal_client import connect
    from belayer.training import run_progress

    client = await connect(config.temporal, config.storage.encryption_key)
    handle = client.get_workflow_handle(run_id)
    while True:
        try:
            progress = await run_progress(client, run_id)
        except Exception:  # not started yet
            progress = None
        if progress is not None and progress.phase == "publish" and 1 <= progress.iteration < ITERATIONS - 1:
            await handle.terminate(reason="the test stops the run mid-iteration")
            return progress.iteration
        if progress is not None and (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
            raise AssertionError(f"the run ended before it could be stopped while publishing: {progress}")
        await asyncio.sleep(0.1)


def checkpoint_weights(config, run_id: str, iteration: int) -> dict:
    """The weights of the trainer checkpoint written after `iteration`, from the stack's store."""
    from belayer.storage.store import open_store
    from belayer.trainer.state import checkpoint_key, decode_checkpoint

    key = checkpoint_key(run_id, iteration)
    with open_store(config.storage, encrypted=False) as store:
        return decode_checkpoint(key, store.get_bytes(key)).weights_only()


def same_tensors(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def built_weights_sha256() -> str:
    """The sha256 of the built model's weights as the trainer stores them."""
    from safetensors.torch import save

    from belayer.model.build import model_path

    built = load_file(str(model_path(MODEL) / "model.safetensors"))
    return hashlib.sha256(save({k: v.contiguous() for k, v in built.items()})).hexdigest()


async def _children(config, run_id: str) -> int:
    from belayer.temporal_client import connect

    client = await connect(config.temporal)
    found = [
        w
        async for w in client.list_workflows(
            f"BelayerRun = '{run_id}' AND WorkflowType = 'TrajectoryWorkflow'"
        )
    ]
    return len(found)


def test_an_infrastructure_failure_is_retried_then_its_group_dropped_never_scored(stack, tmp_path):
    """A task whose sandbox cannot be created ends every attempt failed_infra: its members
    are run again fresh, then the group goes whole, with the reason; it never scores 0."""
    learn = yaml.safe_load((ROOT / "examples/workloads/learn.yaml").read_text())["tasks"]
    broken = {
        "id": "setup-fails",
        "setup": ["echo cannot prepare >&2; exit 3"],
        "instruction": "anything",
        "max_turns": 1,
        "check": "true",
    }
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump({"tasks": [broken, learn[0]]}))
    report = train(
        stack[1],
        str(path),
        "--iterations",
        "1",
        "--group-size",
        "2",
        "--tasks-per-iteration",
        "2",
        "--max-infra-retries",
        "1",
    )
    (iteration,) = report["iterations"]
    assert (iteration["groups_kept"], iteration["groups_dropped"], iteration["infra_retries"]) == (1, 1, 2)
    (dropped,) = iteration["dropped"]
    assert dropped["group"] == "setup-fails" and "cannot prepare" in dropped["reason"]
    rewards = dict(zip(iteration["tasks"], iteration["rewards"], strict=True))
    assert rewards["setup-fails"] == [None, None], "an infrastructure failure is no reward, not a zero"
    kept = rewards[learn[0]["id"]]
    assert None not in kept and iteration["mean_reward"] == sum(kept) / len(kept)


def test_the_client_example_starts_and_follows_a_run(stack, tmp_path):
    """examples/train_with_client.py, as a user runs it: one iteration of one task with one
    held-out task; a line per iteration, then the result, which `belayer train status` agrees with."""
    learn = yaml.safe_load((ROOT / "examples/workloads/learn.yaml").read_text())["tasks"]
    heldout = yaml.safe_load((ROOT / "examples/workloads/learn-heldout.yaml").read_text())["tasks"]
    (tmp_path / "heldout.yaml").write_text(yaml.safe_dump({"tasks": heldout[:1]}))
    (tmp_path / "one.yaml").write_text(yaml.safe_dump({"tasks": learn[:1], "heldout": "heldout.yaml"}))
    run_id = f"example-{uuid.uuid4().hex[:6]}"
    done = subprocess.run(
        [
            sys.executable,
            "examples/train_with_client.py",
            str(tmp_path / "one.yaml"),
            "--iterations",
            "1",
            "--group-size",
            "2",
            "--tasks-per-iteration",
            "1",
            "--run-id",
            run_id,
        ],
        env=stack[1],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )
    assert done.returncode == 0, f"the example failed:\n{done.stdout}\n{done.stderr}"
    started, iteration, ended = done.stdout.splitlines()
    assert started.startswith(f"run {run_id}: 1 iterations of 1 tasks x 2 trajectories")
    (record,) = json.loads(belayer(stack[1], "train", "status", run_id, "--json").stdout)["iterations"]
    assert iteration == (
        f"iteration 0: mean reward {record['mean_reward']:.3f}, held-out reward "
        f"{record['heldout_reward']:.3f}, weights v{record['weights_version']}"
    )
    assert ended == f"run {run_id}: completed, 1 iterations, final weights sha256 {record['weights_sha256']}"


def test_run_forks_each_tasks_group_and_fork_branches_a_finished_trajectory(stack, tmp_path):
    """`belayer run -n 3`: one set-up sandbox per task, three forks; `belayer fork` of one of
    them after step 2, with its seed, replays its last steps exactly."""
    _, env = stack
    workload = tmp_path / "traces.yaml"
    workload.write_text(yaml.safe_dump({"tasks": TRACE_TASKS[:1]}))
    ran = json.loads(belayer(env, "run", str(workload), "-n", "3", "--keep-checkpoints", "--json").stdout)
    [group] = ran["groups"]
    assert (group["forked"], group["size"], group["fallback"]) == (3, 3, ""), group
    members = ran["trajectories"]
    assert [m["status"] for m in members] == ["completed"] * 3
    assert len({(m["token_sha256"], m["env_sha256"]) for m in members}) == 1  # identical starts, same trace

    parent = members[0]
    branched = json.loads(belayer(env, "fork", parent["id"], "--at-step", "2", "-n", "2", "--seed", "0",
                                  "--json").stdout)["trajectories"]  # fmt: skip
    assert [b["status"] for b in branched] == ["completed"] * 2
    for branch in branched:
        assert (branch["token_sha256"], branch["env_sha256"], branch["turns"]) == (
            parent["token_sha256"],
            parent["env_sha256"],
            parent["turns"],
        )
        [start] = branch["recoveries"]  # the sandbox: a kept checkpoint at or before step 2, then replay
        assert start["kind"] == "fork" and start["consistent"] and start["step"] == 2, start
    refused = belayer(env, "fork", parent["id"], "--at-step", "9", check=False)
    assert refused.returncode != 0 and "has steps 1..4" in refused.stderr


def test_a_workload_trains_on_harbor_tasks_beside_its_own_and_holds_out_a_harbor_dataset(stack, tmp_path):
    """`harbor:` in a workload and a Harbor task as its `heldout:`: one iteration of GRPO on a
    learn task and a shipped Harbor task (the policy prompted with its instruction.md, graded
    by its own tests), the Harbor group forked from one set-up sandbox of the task's image."""
    learn = yaml.safe_load((ROOT / "examples/workloads/learn.yaml").read_text())["tasks"][:1]
    workload = tmp_path / "mixed.yaml"
    workload.write_text(yaml.safe_dump({
        "tasks": learn, "harbor": [str(ROOT / "examples/tasks/py-interval-merge")],
        "heldout": str(ROOT / "examples/tasks/csv-sales-summary"),
    }))  # fmt: skip
    ran = train(
        stack[1], str(workload), "--iterations", "1", "--group-size", "2", "--tasks-per-iteration", "2"
    )
    (record,) = ran["iterations"]
    assert (record["groups_kept"], record["groups_dropped"], record["infra_retries"]) == (2, 0, 0), record
    groups = {group["task"]: group for group in record["group_sandboxes"]}
    assert set(groups) == {learn[0]["id"], "py-interval-merge"} and groups["py-interval-merge"]["forked"] == 2
    assert all(0.0 <= reward <= 1.0 for group in record["rewards"] for reward in group)
    assert record["heldout_reward"] is not None and 0.0 <= record["heldout_reward"] <= 1.0, record
