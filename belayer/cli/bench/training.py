"""`belayer bench training`: its options and output; the benchmark itself is `belayer.bench.training`."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import click

from belayer.bench.training import (
    DEFAULT_WORKLOAD,
    FALLBACK_WORKLOAD,
    MODES,
    BenchRun,
    fault_plan,
    print_report,
    summarize,
)
from belayer.cli.bench.output import report_and_exit
from belayer.cli.context import config_from
from belayer.trainer.models import TrainerSettings
from belayer.workloads.loader import load_workload


@click.command("training")
@click.option(
    "--workload",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Workload file [default: examples/workloads/learn.yaml, else overhead.yaml].",
)
@click.option("--iterations", default=2, show_default=True, type=click.IntRange(1, 1000))
@click.option("--group-size", default=2, show_default=True, type=click.IntRange(2, 256))
@click.option("--tasks-per-iteration", default=2, show_default=True, type=click.IntRange(1, 4096))
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(0, 2**31 - 1),
    help="The runs' seed (task draws, sampling): the same for every run.",
)
@click.option(
    "--lr",
    default=TrainerSettings().lr,
    show_default=True,
    type=click.FloatRange(0),
    help="AdamW learning rate.",
)
@click.option(
    "--chaos-seed",
    default=0,
    show_default=True,
    type=int,
    help="Seed of the fault schedule (the order of the fixed plan, or --chaos-rate's draw).",
)
@click.option(
    "--chaos-rate",
    default=None,
    type=float,
    help="Draw random_training_plan(rate, chaos_seed, iterations) over every fault kind instead of "
    "the fixed plan (engine-crash, sandbox-crash, sandbox-host-crash).",
)
@click.option(
    "--repetitions",
    default=3,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Each of the four runs this many times, interleaved; figures are min/median/max.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.pass_context
def training(
    ctx: click.Context,
    workload: Path | None,
    iterations: int,
    group_size: int,
    tasks_per_iteration: int,
    seed: int,
    lr: float,
    chaos_seed: int,
    chaos_rate: float | None,
    repetitions: int,
    as_json: bool,
) -> None:
    """Training runs with Belayer's protections on vs off: failure-free overhead, and goodput
    under one seeded schedule of real faults (Belayer's recovery vs restart-from-scratch).

    Runs on the stack of the effective configuration and injects real faults into it, and
    restarts its rollout node: use a stack of your own (`BELAYER_STATE_DIR=... belayer up`).
    """

    config = config_from(ctx.find_root())
    if not config.rollout.shadow:
        raise click.UsageError("the configuration has rollout.shadow = false; the protected runs need it on")
    workload = workload or (DEFAULT_WORKLOAD if DEFAULT_WORKLOAD.exists() else FALLBACK_WORKLOAD)
    loaded = load_workload(workload)
    tasks, model = loaded.tasks, loaded.model or config.rollout.model
    if tasks_per_iteration > len(tasks):
        raise click.UsageError(f"{workload} has {len(tasks)} tasks, fewer than --tasks-per-iteration")
    plan = fault_plan(iterations, chaos_seed, chaos_rate)

    def say(message: str) -> None:
        click.echo(f"[bench] {message}", err=True)

    bench = BenchRun(
        config,
        tasks,
        iterations=iterations,
        group_size=group_size,
        tasks_per_iteration=tasks_per_iteration,
        seed=seed,
        lr=lr,
        plan=plan,
        say=say,
        model=model,
    )
    say(
        f"{repetitions} repetitions x {len(MODES)} runs of {iterations} iterations ({tasks_per_iteration} tasks x "
        f"{group_size}) on {workload.name}, model {model}; faults: "
        + ", ".join(f"{p.fault}@iteration={p.iteration}" for p in plan)
    )
    # The Temporal SDK's core can log on stdout (a restarted server): keep stdout for the JSON.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        runs = asyncio.run(bench.run(repetitions))
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    settings = {
        "workload": str(workload),
        "model": model,
        "iterations": iterations,
        "group_size": group_size,
        "tasks_per_iteration": tasks_per_iteration,
        "seed": seed,
        "lr": lr,
        "chaos_seed": chaos_seed,
        "chaos_rate": chaos_rate,
        "cpu_cores": os.cpu_count(),
        "load_average_1m_end": os.getloadavg()[0],
    }
    report_and_exit(summarize(runs, settings=settings, plan=plan), as_json=as_json, print_table=print_report)
