"""Start a Belayer training run from your own code with the Temporal client, and follow it.

    .venv/bin/belayer up                          # the local stack and Belayer's workers
    .venv/bin/python examples/train_with_client.py examples/workloads/learn.yaml --iterations 3
    .venv/bin/python examples/train_with_client.py --help

This is what `belayer train` does, spelled out with the Temporal Python client:

1. load a workload file (its `tasks:`, and the `model:`, `heldout:`, `lr:`, `group_size:` and
   `kl_coef:` it may name); what is not given defaults as in `belayer train`;
2. build the run's `TrainingInput` with `belayer.training.training_input`, which fills in
   what the stack's configuration knows: the task queues, the rollout nodes, the model
   the engines serve, the policy and the token budget;
3. store the tasks once in the object store (`belayer.training.tasks_by_reference`: the
   workflow's input then holds a pointer, whatever the dataset's size), claim the run id
   (`belayer.training.claim_run_id`: one used before with other settings is refused) and
   start the `TrainingWorkflow` on the stack's workflow task queue; the workflow id is the
   run id;
4. poll the workflow's `progress` query (`TrainingProgress`) and print one line per
   finished iteration: its mean reward, held-out reward and the weights version it
   published;
5. print the `TrainingResult` when the run ends.

The run is durable: stopping this script (Ctrl-C) leaves it going; `belayer train status
RUN` shows it later. Connect through `belayer.temporal_client.connect`: it reads the same
configuration as `belayer up` and uses the workers' data converter (pydantic, plus payload
encryption when `temporal.encrypt_payloads` is on). The exit status is 1 when the run
failed for an infrastructure reason.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from belayer.config import BelayerConfig, load_config
from belayer.storage.store import open_store
from belayer.temporal_client import connect
from belayer.trainer.models import TrainerSettings
from belayer.training import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_ITERATIONS,
    DEFAULT_TASKS_PER_ITERATION,
    claim_run_id,
    default_settings,
    tasks_by_reference,
    training_input,
    tuned,
)
from belayer.workflows.rollouts import RUN_KEY
from belayer.workflows.training_models import IterationRecord, TrainingInput, TrainingProgress, TrainingResult
from belayer.workloads.loader import load_workload

POLL_S = 1.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workload", type=Path, help="A workload file (.yaml or .jsonl).")
    parser.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help=f"Optimizer steps (default {DEFAULT_ITERATIONS}, as `belayer train`).",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"Trajectories per task per iteration (default: the workload's `group_size:`, else "
        f"{DEFAULT_GROUP_SIZE}).",
    )
    parser.add_argument(
        "--tasks-per-iteration",
        type=int,
        default=DEFAULT_TASKS_PER_ITERATION,
        help=f"Tasks drawn per iteration (default {DEFAULT_TASKS_PER_ITERATION}).",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Fixes the task draws and sampling seeds (default 0)."
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"AdamW learning rate (default: the workload's `lr:`, else {TrainerSettings().lr:g}).",
    )
    parser.add_argument(
        "--heldout",
        type=Path,
        default=None,
        help="Held-out tasks evaluated every iteration (default: the workload's `heldout:`).",
    )
    parser.add_argument("--run-id", default=None, help="The run's id (default train-<random>).")
    return parser.parse_args()


def run_input(config: BelayerConfig, args: argparse.Namespace) -> TrainingInput:
    """The run's input: the workload's tasks and model, the stack's queues and policy."""
    workload = load_workload(args.workload)
    heldout = args.heldout or workload.heldout
    return training_input(
        config,
        workload.tasks,
        iterations=args.iterations,
        group_size=tuned("group_size", args.group_size, workload),
        tasks_per_iteration=args.tasks_per_iteration,
        seed=args.seed,
        heldout=load_workload(heldout).tasks if heldout else None,
        settings=default_settings(args.iterations).model_copy(
            update={"lr": tuned("lr", args.lr, workload), "kl_coef": tuned("kl_coef", None, workload)}
        ),
        run_id=args.run_id,
        model=workload.model,
    )


async def start(client: Client, config: BelayerConfig, input: TrainingInput) -> WorkflowHandle:
    """Start the run with its tasks stored; the BelayerRun search attribute lets the web UI
    list it with its trajectories. The run id is claimed first: one used before with other
    settings is refused."""
    with open_store(config.storage, encrypted=False) as store:
        input = tasks_by_reference(store, input)
        claim_run_id(store, input)
    return await client.start_workflow(
        "TrainingWorkflow",
        input,
        id=input.run_id,
        task_queue=config.temporal.workflow_task_queue,
        result_type=TrainingResult,
        search_attributes=TypedSearchAttributes([SearchAttributePair(RUN_KEY, input.run_id)]),
    )


async def follow(handle: WorkflowHandle) -> TrainingResult:
    """Poll `progress` until the run ends, printing each iteration once it is recorded."""
    result = asyncio.ensure_future(handle.result())
    printed = 0
    while True:
        finished = result.done()  # decided before the query, so the last query sees every iteration
        progress = await handle.query("progress", result_type=TrainingProgress)
        printed = print_new(progress.recent, printed)
        if finished:
            return result.result()
        await asyncio.wait({result}, timeout=POLL_S)


def print_new(records: list[IterationRecord], printed: int) -> int:
    """Print the records of iterations from `printed` on; the next iteration to print.
    (`progress.recent` holds the last few records, so a poll every second misses none.)"""
    for record in records:
        if record.iteration >= printed:
            heldout = "-" if record.heldout_reward is None else f"{record.heldout_reward:.3f}"
            reward = "-" if record.mean_reward is None else f"{record.mean_reward:.3f}"
            print(
                f"iteration {record.iteration}: mean reward {reward}, held-out reward {heldout}, "
                f"weights v{record.weights_version}",
                flush=True,
            )
            printed = record.iteration + 1
    return printed


async def main() -> int:
    args = parse_args()
    config = load_config()
    input = run_input(config, args)
    client = await connect(config.temporal, config.storage.encryption_key)
    handle = await start(client, config, input)
    print(
        f"run {input.run_id}: {input.iterations} iterations of {input.tasks_per_iteration} tasks x "
        f"{input.group_size} trajectories, model {input.model}",
        flush=True,
    )
    result = await follow(handle)
    print(
        f"run {result.run_id}: {result.status}, {result.iterations_done} iterations, "
        f"final weights sha256 {result.final_weights_sha256}"
        + (f"; {result.reason}" if result.reason else ""),
        flush=True,
    )
    return 1 if result.status == "failed_infra" else 0


if __name__ == "__main__":
    os._exit(
        asyncio.run(main())
    )  # the SDK can abort at interpreter exit in short scripts (docs/design.md §7)
