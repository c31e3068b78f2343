"""`belayer bench long-trajectory`: its options and output;
the benchmark itself is `belayer.bench.history`."""

from __future__ import annotations

import asyncio
import time

import click
from rich.console import Console
from temporalio.worker import Worker

from belayer.bench.history import long_trace, print_report, run_one, summarize
from belayer.cli.bench.output import report_and_exit
from belayer.cli.context import config_from
from belayer.measure import machine_load
from belayer.model.build import model_path
from belayer.storage.store import open_store
from belayer.temporal_client import connect
from belayer.testing import ScriptedRollout


@click.command("long-trajectory")
@click.option(
    "--turns",
    default=2000,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="Turns of the trace trajectory.",
)
@click.option(
    "--continue-as-new-every",
    "every",
    default=100,
    show_default=True,
    type=click.IntRange(1),
    help="Steps per workflow run.",
)
@click.option(
    "--output-bytes",
    default=200,
    show_default=True,
    type=click.IntRange(0, 65536),
    help="Bytes each action prints (observations are stored, never in payloads).",
)
@click.option(
    "--repetitions",
    default=3,
    show_default=True,
    type=click.IntRange(1, 50),
    help="Trajectories run one after another; sizes are their largest, times min / median / max.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.pass_context
def long_trajectory(
    ctx: click.Context, turns: int, every: int, output_bytes: int, repetitions: int, as_json: bool
) -> None:
    """Run a trace trajectory of many turns and report its histories against Temporal's limits."""

    config = config_from(ctx.find_root())
    err = Console(stderr=True)

    async def main() -> dict:

        client = await connect(config.temporal, config.storage.encryption_key)
        task = long_trace(turns, output_bytes)
        run_name = f"long-{turns}-{int(time.time())}"
        engine_queue = f"belayer-bench-scripted-{run_name}"
        tokenizer = model_path(config.rollout.model, config.cache_dir) / "tokenizer.json"
        engine = ScriptedRollout(
            open_store(config.storage, encrypted=False), tokenizer, node_queue=engine_queue
        )
        load = machine_load()
        trajectories = []
        async with Worker(client, task_queue=engine_queue, activities=[engine.generate]):
            for rep in range(1, repetitions + 1):
                trajectories.append(
                    await run_one(
                        client,
                        config,
                        task,
                        every=every,
                        engine_queue=engine_queue,
                        trajectory_id=f"{run_name}-{rep}",
                        say=lambda line, rep=rep: err.print(
                            f"repetition {rep}/{repetitions} {line}", highlight=False
                        ),
                    )
                )
        return summarize(trajectories, turns=turns, every=every) | {
            "machine": load | {"after": machine_load()["load_avg"]}
        }

    report_and_exit(asyncio.run(main()), as_json=as_json, print_table=print_report)
