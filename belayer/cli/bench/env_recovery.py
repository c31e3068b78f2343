"""`belayer bench env-recovery`: its options and output;
the benchmark itself is `belayer.bench.env_recovery`."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

from belayer.bench.env_recovery import Realistic, print_report, run_bench
from belayer.config import load_config
from belayer.measure import machine_load
from belayer.sandbox.localstore import LocalDirStore


@click.command("env-recovery")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--workload", "names", multiple=True, help="Run only these workloads (repeatable).")
@click.option(
    "--scale",
    type=click.FloatRange(0.01, 10),
    default=1.0,
    show_default=True,
    help="Scale the data sizes of every workload.",
)
@click.option(
    "--repetitions",
    type=click.IntRange(1, 50),
    default=3,
    show_default=True,
    help="Best case: recoveries by each method from the one checkpoint, methods interleaved; "
    "figures are min / median / max. (The realistic case's samples are its --failures.)",
)
@click.option(
    "--archive-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep checkpoints in this directory instead of the configured object store.",
)
@click.option(
    "--realistic/--best-case-only",
    default=True,
    show_default=True,
    help="Also run the realistic case: the adaptive policy's own checkpoints, faults at random moments of its run.",
)
@click.option(
    "--failures",
    type=click.IntRange(1, 100),
    default=5,
    show_default=True,
    help="Realistic case: faults per workload, at random moments of its run.",
)
@click.option(
    "--seed",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Realistic case: seed of the fault times and the simulated generation lengths.",
)
@click.option(
    "--decode-ms-per-token",
    type=click.FloatRange(0.1, 1000),
    default=20.0,
    show_default=True,
    help="Realistic case: the simulated generations' decode time per token.",
)
@click.pass_context
def env_recovery(ctx: click.Context, as_json: bool, names: tuple[str, ...], scale: float, repetitions: int,
                 archive_dir: str | None, realistic: bool, failures: int, seed: int,
                 decode_ms_per_token: float) -> None:  # fmt: skip
    """Environment recovery: Belayer's full restore vs replay vs fs-only, same run.

    The best case places one checkpoint at a late step; the realistic case runs each
    workload under the adaptive policy (policy.* settings) and strikes it at random
    moments of its run.
    """
    config = load_config((ctx.obj or {}).get("config_file"))
    store = None
    if archive_dir:
        store = LocalDirStore(Path(archive_dir))
    err = Console(stderr=True)
    settings = Realistic(failures=failures, seed=seed, decode_s_per_token=decode_ms_per_token / 1000)
    load = machine_load()
    result = run_bench(config, store=store, names=list(names) or None, scale=scale, repetitions=repetitions,
                       realistic=settings if realistic else None,
                       log_fn=lambda m: err.print(m, highlight=False))  # fmt: skip
    result["machine"] = load | {"after": machine_load()["load_avg"]}
    if as_json:
        click.echo(json.dumps(result))
    else:
        print_report(result)
