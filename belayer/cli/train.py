"""`belayer train WORKLOAD` and `belayer train status RUN`: start a durable GRPO run and
follow it, or look at one later."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from temporalio.service import RPCError

from belayer.chaos.plan import parse_plan, random_training_plan
from belayer.chaos.training import TrainingChaos, policy_tasks_of
from belayer.cli.context import config_from
from belayer.client import result_through_restarts, ui_link
from belayer.errors import BelayerError
from belayer.report.tensorboard import EventLog, rewards_by_family
from belayer.temporal_client import connect
from belayer.trainer.algorithms import ALGORITHMS, DEFAULT
from belayer.trainer.models import TrainerSettings
from belayer.training import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_ITERATIONS,
    DEFAULT_TASKS_PER_ITERATION,
    MAX_DEFAULT_CONCURRENCY,
    read_iterations,
    resume_training,
    run_progress,
    run_storage,
    start_training,
    training_input,
    tuned,
)
from belayer.workloads.harbor_tasks import runnable_workload
from belayer.workloads.loader import WorkloadError

console = Console(stderr=True)
LOGDIR = click.option(
    "--logdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write each iteration's metrics as TensorBoard event files under LOGDIR/<run id> "
    "(`tensorboard --logdir LOGDIR`).",
)
POLL_S = 1.0
TRAINER_DEFAULTS = TrainerSettings()  # one set of defaults: the library's


class _TrainGroup(click.Group):
    """`belayer train WORKLOAD ...` starts a run; `belayer train status RUN` shows one."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["start", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_TrainGroup)
def train() -> None:
    """Train with GRPO (or another --algorithm) on a workload's tasks, durably (Temporal), starting from the workload's
    `model:` (default: the model the engines serve), published into the running engines.

    \b
    belayer train WORKLOAD [options]   start a run and follow it (see `belayer train start --help`)
    belayer train status RUN           a run's iterations so far
    belayer train resume RUN           continue a run that failed or was terminated
    """


@train.command("start")
@click.argument("workload", type=click.Path(path_type=Path))
@click.option(
    "--iterations",
    default=DEFAULT_ITERATIONS,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Iterations; each rolls out a batch, then takes --minibatches optimizer steps on it.",
)
@click.option(
    "--group-size",
    default=None,
    type=click.IntRange(2, 256),
    help=f"Trajectories per task per iteration (a GRPO group) [default: the workload's `group_size:`, "
    f"else {DEFAULT_GROUP_SIZE}].",
)
@click.option(
    "--tasks-per-iteration",
    default=DEFAULT_TASKS_PER_ITERATION,
    show_default=True,
    type=click.IntRange(1, 4096),
    help="Tasks drawn (seeded) for each iteration.",
)
@click.option(
    "--concurrency",
    default=None,
    type=click.IntRange(1, 4096),
    help="Trajectories (and so sandboxes) running at once; groups are set up under this limit too "
    f"[default: an iteration's trajectories, train and held-out, up to {MAX_DEFAULT_CONCURRENCY}].",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(0, 2**31 - 1),
    help="Fixes the task draws and every sampling seed.",
)
@click.option(
    "--algorithm",
    type=click.Choice(sorted(ALGORITHMS)),
    default=DEFAULT,
    show_default=True,
    help="How group rewards become advantages and which loss the trainer takes "
    "(docs/design.md §10, where to add an algorithm).",
)
@click.option(
    "--lr",
    default=None,
    type=click.FloatRange(0),
    help=f"AdamW learning rate [default: the workload's `lr:`, else {TRAINER_DEFAULTS.lr:g}].",
)
@click.option(
    "--lr-decay",
    type=click.Choice(["constant", "linear"]),
    default="linear",
    show_default=True,
    help="linear: the learning rate falls linearly from --lr to 0 over the run's iterations.",
)
@click.option(
    "--minibatches",
    default=TRAINER_DEFAULTS.minibatches,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Optimizer steps per iteration, each on a seeded shuffle's slice of the batch (clipping "
    "acts from the second on).",
)
@click.option(
    "--kl-coef",
    default=None,
    type=click.FloatRange(0),
    help="Weight of a KL penalty to the start weights (k3 estimator); 0 is off [default: the "
    f"workload's `kl_coef:`, else {TRAINER_DEFAULTS.kl_coef:g}].",
)
@click.option(
    "--temperature",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 5, min_open=True),
    help="Sampling temperature of the rollouts (and of the trainer's logprobs).",
)
@click.option(
    "--heldout",
    type=click.Path(path_type=Path),
    default=None,
    help="A workload evaluated once per iteration, never trained on (default: the workload's `heldout:`).",
)
@click.option("--no-heldout", is_flag=True, help="Evaluate no held-out tasks, whatever the workload names.")
@click.option(
    "--max-infra-retries",
    default=2,
    show_default=True,
    type=click.IntRange(0, 16),
    help="Fresh runs (same seed) of a trajectory that ended failed_infra; then its group is dropped.",
)
@click.option(
    "--fork/--no-fork",
    "fork_groups",
    default=True,
    show_default=True,
    help="Fork each group's sandboxes from one set-up sandbox (tasks with setup commands).",
)
@click.option(
    "--reuse-setup/--no-reuse-setup",
    default=None,
    help="Later iterations fork a task's set-up checkpoint again instead of rerunning its setup "
    "(default: on for workloads of up to 256 tasks, since the run keeps one per task drawn).",
)
@click.option(
    "--skip-uniform-groups",
    is_flag=True,
    help="Leave out of each step the groups whose members all scored the same (DAPO's dynamic "
    "sampling); they are counted either way.",
)
@click.option(
    "--keep-last",
    type=click.IntRange(1, None),
    default=None,
    help="Keep the trainer checkpoints (and weights) of the last N iterations and delete older ones "
    "as the run goes  [default: keep every one]",
)
@click.option(
    "--keep-every",
    type=click.IntRange(1, None),
    default=None,
    help="With --keep-last: also keep every K-th iteration's checkpoint (iterations K-1, 2K-1, ...).",
)
@click.option(
    "--run-id",
    default=None,
    help="Name of the run (default train-<random>); one used before with other settings is refused.",
)
@click.option(
    "--chaos",
    "chaos_plan",
    default=None,
    metavar="PLAN",
    help="Inject real faults: a .yaml plan or e.g. 'engine-crash@iteration=0,trainer-crash@iteration=1'.",
)
@click.option("--chaos-rate", type=float, default=None, help="Seeded random faults per iteration (0-1].")
@click.option("--chaos-seed", type=int, default=0, show_default=True, help="Seed of --chaos-rate.")
@LOGDIR
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object when the run ends.")
@click.pass_context
def start(
    ctx: click.Context,
    workload: Path,
    iterations: int,
    group_size: int | None,
    tasks_per_iteration: int,
    concurrency: int | None,
    seed: int,
    algorithm: str,
    lr: float | None,
    lr_decay: str,
    minibatches: int,
    kl_coef: float | None,
    temperature: float,
    heldout: Path | None,
    no_heldout: bool,
    max_infra_retries: int,
    fork_groups: bool,
    reuse_setup: bool | None,
    skip_uniform_groups: bool,
    keep_last: int | None,
    keep_every: int | None,
    run_id: str | None,
    chaos_plan: str | None,
    chaos_rate: float | None,
    chaos_seed: int,
    logdir: Path | None,
    as_json: bool,
) -> None:
    """Start a training run on WORKLOAD (.yaml or .jsonl, or a Harbor task directory or
    dataset) and follow it to its end.

    Exit status 1 when the run failed for an infrastructure reason. Ctrl-C leaves the run
    going; follow it with `belayer train status RUN` or in the Temporal web UI.
    """

    config = config_from(ctx.find_root())
    progress = lambda line: console.print(f"  {line}", highlight=False, markup=False)  # noqa: E731 (stderr)
    loaded = runnable_workload(config, workload, progress=progress)
    tasks = loaded.tasks
    if tasks_per_iteration > len(tasks):
        raise WorkloadError(
            f"{workload} has {len(tasks)} tasks, fewer than --tasks-per-iteration "
            f"{tasks_per_iteration}; lower it or add tasks"
        )
    if keep_every is not None and keep_last is None:
        raise click.UsageError("--keep-every needs --keep-last (without it every checkpoint is kept anyway)")
    if heldout and no_heldout:
        raise click.UsageError("--heldout and --no-heldout contradict each other; give one")
    heldout = None if no_heldout else heldout or loaded.heldout
    settings = TrainerSettings(
        algorithm=algorithm,
        lr=tuned("lr", lr, loaded),
        lr_decay_iterations=iterations if lr_decay == "linear" else 0,
        minibatches=minibatches,
        kl_coef=tuned("kl_coef", kl_coef, loaded),
        temperature=temperature,
    )
    group_size = tuned("group_size", group_size, loaded)
    heldout_tasks = runnable_workload(config, heldout, progress=progress).tasks if heldout else None
    input = training_input(
        config,
        tasks,
        iterations=iterations,
        group_size=group_size,
        tasks_per_iteration=tasks_per_iteration,
        seed=seed,
        heldout=heldout_tasks,
        settings=settings,
        run_id=run_id,
        temperature=temperature,
        max_infra_retries=max_infra_retries,
        model=loaded.model,
        fork_groups=fork_groups,
        reuse_setup=reuse_setup,
        skip_uniform_groups=skip_uniform_groups,
        keep_last=keep_last,
        keep_every=keep_every,
        concurrency=concurrency,
    )
    plan = _chaos_plan(chaos_plan, chaos_rate, chaos_seed, iterations)
    started = time.monotonic()
    try:
        result, records, faults = asyncio.run(_run(config, input, plan, quiet=as_json, logdir=logdir))
    except KeyboardInterrupt:
        console.print(
            f"\n[yellow]interrupted[/]: run {input.run_id} goes on. Follow it with\n"
            f"  belayer train status {input.run_id}\nor in the web UI: {_ui(config, input.run_id)}"
        )
        os._exit(130)
    report = run_report(result, records, run_settings(input, workload)) | ({"faults": faults} if plan else {})
    _end(report, result, as_json, started)


@train.command("status")
@click.argument("run_id")
@LOGDIR
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def status(ctx: click.Context, run_id: str, logdir: Path | None, as_json: bool) -> None:
    """Show run RUN_ID: its state and every iteration recorded so far."""
    config = config_from(ctx.find_root())
    progress, records = asyncio.run(_status(config, run_id))
    if logdir is not None:
        events = EventLog(logdir, run_id)
        events.write(records)
        events.close()
    storage = run_storage(config, run_id)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "run_id": run_id,
                    "status": progress.status,
                    "phase": progress.phase,
                    **run_report(progress, records),
                    "storage": storage,
                },
                indent=2,
            )
        )
        return
    console.print(
        f"run {run_id}: {progress.status}, iteration {progress.iteration}/{progress.iterations} "
        f"({progress.phase}), weights v{progress.serving_version}"
    )
    for record in records:
        console.print("  " + iteration_line(record), highlight=False)
    checkpoints = storage["checkpoints"]
    console.print(
        f"storage: {storage['bytes'] / 2**20:.1f} MiB in {storage['objects']} objects under runs/{run_id}/; "
        f"{len(checkpoints)} trainer checkpoints"
        + (f" (iterations {', '.join(map(str, checkpoints))})" if checkpoints else "")
    )
    console.print(f"web UI: {_ui(config, run_id)}")


@train.command("resume")
@click.argument("run_id")
@LOGDIR
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object when the run ends.")
@click.pass_context
def resume(ctx: click.Context, run_id: str, logdir: Path | None, as_json: bool) -> None:
    """Continue run RUN_ID, which ended failed_infra or was terminated, from the checkpoint
    of its last recorded iteration, with the settings it started with; it ends as it would
    have without stopping (the same rewards and weights).

    An iteration it had begun but not recorded runs again. Exit status 1 when the run
    fails again for an infrastructure reason.
    """
    config = config_from(ctx.find_root())
    started = time.monotonic()
    try:
        input, result, records = asyncio.run(_resume(config, run_id, quiet=as_json, logdir=logdir))
    except KeyboardInterrupt:
        console.print(
            f"\n[yellow]interrupted[/]: run {run_id} goes on. Follow it with\n  belayer train status {run_id}"
        )
        os._exit(130)
    _end(run_report(result, records, run_settings(input, None)), result, as_json, started)


def _end(report: dict, result, as_json: bool, started: float) -> None:
    """Print the run's end and exit: 1 when it ended failed_infra."""
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_end(report, time.monotonic() - started)
    sys.stdout.flush()
    # Exit without interpreter teardown: the Temporal SDK can abort at exit (docs/design.md §7).
    os._exit(1 if result.status == "failed_infra" else 0)


def _chaos_plan(plan: str | None, rate: float | None, seed: int, iterations: int) -> list:
    if plan and rate is not None:
        raise click.UsageError("give --chaos or --chaos-rate, not both")
    if plan:
        parsed = parse_plan(plan)
        stepped = [p.fault for p in parsed if p.step is not None]
        if stepped:
            raise click.UsageError(
                f"{stepped[0]}@step: a training run's faults take @iteration=K or @t=SECONDS"
            )
        return parsed
    return random_training_plan(rate, seed, iterations) if rate is not None else []


async def _run(config, input, plan, *, quiet: bool, logdir: Path | None):
    client = await connect(config.temporal, config.storage.encryption_key)
    handle = await start_training(client, config, input)
    if not quiet:
        console.print(
            f"run {input.run_id}: {input.iterations} iterations of {input.tasks_per_iteration} tasks x "
            f"{input.group_size} trajectories; web UI {_ui(config, input.run_id)}"
        )
    return await _follow(config, client, handle, input, plan, quiet=quiet, logdir=logdir)


async def _resume(config, run_id: str, *, quiet: bool, logdir: Path | None):
    client = await connect(config.temporal, config.storage.encryption_key)
    handle, input = await resume_training(client, config, run_id)
    if not quiet:
        done = input.carried.iteration if input.carried else 0
        console.print(
            f"run {run_id} resumed at iteration {done}/{input.iterations} "
            f"(from {'its checkpoint of iteration ' + str(done - 1) if done else 'its start'}); "
            f"web UI {_ui(config, run_id)}"
        )
    result, records, _faults = await _follow(config, client, handle, input, [], quiet=quiet, logdir=logdir)
    return input, result, records


async def _follow(config, client, handle, input, plan, *, quiet: bool, logdir: Path | None):
    """Follow the run to its end, injecting `plan`'s faults (and writing its metrics under
    `logdir` as they come); its result, records and faults."""
    events = EventLog(logdir, input.run_id) if logdir is not None else None
    follower = _Follower(client, input.run_id, events)
    follower.printed = input.carried.iteration if input.carried else 0
    following = None if quiet else asyncio.ensure_future(follower.follow())
    chaos = TrainingChaos(
        config,
        client,
        input.run_id,
        plan,
        say=None if quiet else lambda line: console.print(line, highlight=False),
        policy_tasks=policy_tasks_of(input.tasks),
    )
    injecting = asyncio.ensure_future(chaos.run()) if plan else None
    try:
        result = await result_through_restarts(handle)
    finally:
        for task in (following, injecting):
            if task is not None:
                task.cancel()
    records = await asyncio.to_thread(read_iterations, config, result)
    if not quiet:
        follower.print_new(records)
    if events is not None:
        events.write(records)
        events.close()
    return result, records, chaos.settle()


class _Follower:
    """One line per finished iteration, and a status line for the one in progress."""

    def __init__(self, client, run_id: str, events: EventLog | None = None):
        self.client, self.run_id, self.events = client, run_id, events
        self.printed = 0

    async def follow(self) -> None:
        with console.status("starting") as spinner:
            while True:
                try:
                    progress = await run_progress(self.client, self.run_id)
                except Exception:  # the workflow worker may be restarting: keep asking
                    await asyncio.sleep(POLL_S)
                    continue
                self.print_new(progress.recent)
                spinner.update(
                    f"iteration {progress.iteration}/{progress.iterations}: {progress.phase} "
                    f"({progress.members_done}/{progress.members_total} trajectories), "
                    f"weights v{progress.serving_version}"
                )
                await asyncio.sleep(POLL_S)

    def print_new(self, records) -> None:
        for record in records:
            if record.iteration >= self.printed:
                console.print(iteration_line(record), highlight=False)
                self.printed = record.iteration + 1
        if self.events is not None:
            self.events.write(records)


def iteration_line(record) -> str:
    heldout = f" held-out {record.heldout_reward:.3f}" if record.heldout_reward is not None else ""
    reward = f"{record.mean_reward:.3f}" if record.mean_reward is not None else "-"
    dropped = f", {record.groups_dropped} dropped" if record.groups_dropped else ""
    actions = mean_actions([record])
    acted = f"; {actions:.1f} actions per trajectory" if actions is not None else ""
    flagged = (
        f"; {len(record.recovered_tokens_differ)} trajectories drew other tokens than a replay after an engine "
        f"recovery ({', '.join(record.recovered_tokens_differ)})"
        if record.recovered_tokens_differ
        else ""
    )
    return (
        f"iteration {record.iteration}: reward {reward}{heldout}{acted}{flagged}; groups {record.groups_kept} "
        f"kept{dropped}; "
        f"{record.infra_retries} infra retries; loss {record.loss:.4f}; weights v{record.weights_version} "
        f"{record.weights_sha256[:12]}; rollout {record.rollout_s:.1f}s train {record.train_s:.1f}s "
        f"publish {record.publish_s:.1f}s"
    )


def run_settings(input, workload: Path | None) -> dict:
    """What decides the run's curve, for the report and for reruns (a resumed run's
    workload is the tasks its input carries: no path)."""
    return {
        "workload": str(workload) if workload else None,
        "model": input.model,
        "iterations": input.iterations,
        "group_size": input.group_size,
        "tasks_per_iteration": input.tasks_per_iteration,
        "concurrency": input.concurrency,
        "seed": input.seed,
        "algorithm": input.trainer.algorithm,
        "lr": input.trainer.lr,
        "lr_decay_iterations": input.trainer.lr_decay_iterations,
        "minibatches": input.trainer.minibatches,
        "kl_coef": input.trainer.kl_coef,
        "temperature": input.trainer.temperature,
        "heldout_tasks": len(input.heldout),
        "fork_groups": input.fork_groups,
        "reuse_setup": input.reuse_setup,
        "skip_uniform_groups": input.skip_uniform_groups,
        "keep_last": input.keep_last,
        "keep_every": input.keep_every,
    }


def run_report(result, records, settings: dict | None = None) -> dict:
    """The `--json` object: the run (and its settings when known), one entry per iteration, the final weights."""
    return {
        "run_id": result.run_id,
        "status": result.status,
        **({"settings": settings} if settings else {}),
        **({"reason": result.reason} if getattr(result, "reason", "") else {}),
        "iterations": [
            {
                "iteration": r.iteration,
                "mean_reward": r.mean_reward,
                "heldout_reward": r.heldout_reward,
                "mean_actions_per_trajectory": mean_actions([r]),
                "groups_kept": r.groups_kept,
                "groups_dropped": r.groups_dropped,
                "uniform_groups": r.uniform_groups,
                "infra_retries": r.infra_retries,
                "weights_version": r.weights_version,
                "weights_sha256": r.weights_sha256,
                "rollout_s": r.rollout_s,
                "train_s": r.train_s,
                "publish_s": r.publish_s,
                "recovery_s": r.recovery_s,
                "tokens_after_recovery": r.tokens_after_recovery,
                "recovered_tokens_differ": r.recovered_tokens_differ,
                "elapsed_s": r.elapsed_s,
                "tasks": r.tasks,
                "rewards": r.rewards,
                "actions": r.actions,
                "dropped": [d.model_dump() for d in r.dropped],
                "rewards_by_family": rewards_by_family(r),
                "loss": r.loss,
                "kl": r.kl,
                "clip_fraction": r.clip_fraction,
                "entropy": r.entropy,
                "grad_norm": r.grad_norm,
                "lr": r.lr,
                "response_tokens": r.response_tokens,
                "engine_logprob_drift": r.engine_logprob_drift,
                "group_sandboxes": [
                    g.model_dump(mode="json", exclude={"origin", "setup_sandbox"}) for g in r.group_sandboxes
                ],
            }
            for r in records
        ],
        "mean_actions_per_trajectory": mean_actions(records),
        # the workflow's own word when the run has ended (its result), else the last record's
        "final_weights_sha256": getattr(result, "final_weights_sha256", None)
        or (records[-1].weights_sha256 if records else None),
    }


def mean_actions(records) -> float | None:
    """Actions per trajectory, over the records' trajectories that did not fail on
    infrastructure: how much the policy acts (one that answers without acting runs none)."""
    counted = [actions for r in records for group in r.actions for actions in group if actions is not None]
    return sum(counted) / len(counted) if counted else None


def _print_end(report: dict, wall: float) -> None:
    status = report["status"]
    colour = "green" if status == "completed" else "red"
    console.print(
        f"[{colour}]{status}[/]: {len(report['iterations'])} iterations in {wall:.1f}s; "
        f"final weights sha256 {report['final_weights_sha256']}"
    )
    if report.get("reason"):
        console.print(f"  reason: {report['reason']}")


async def _status(config, run_id: str):
    client = await connect(config.temporal, config.storage.encryption_key)
    try:
        progress = await run_progress(client, run_id)
    except RPCError as exc:
        raise BelayerError(
            f"no training run {run_id!r} on {config.temporal.address}: {exc}; "
            "list runs in the web UI (filter BelayerRun)"
        ) from None
    return progress, await asyncio.to_thread(read_iterations, config, progress)


def _ui(config, run_id: str) -> str:
    return ui_link(config, run_id)
