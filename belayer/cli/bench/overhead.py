"""`belayer bench overhead`: its options and output; the benchmark itself is
`belayer.bench.overhead`. Also the `--workload` and `--task` options that every benchmark
of a trace task shares (overhead, checkpoint, turn-overhead)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
from rich.console import Console

from belayer.bench.overhead import DEFAULT_WORKLOAD, load_trace_task, print_report, run_bench, stack_target
from belayer.cli.bench.output import report_and_exit
from belayer.cli.context import config_from
from belayer.temporal_client import connect


def trace_task_options(default_workload: Path):
    """`--workload FILE` and `--task ID`: the trace task a benchmark runs (`load_trace_task`)."""

    def add(command):
        command = click.option(
            "--task", "task_id", default=None, help="Trace task of the workload (default: the first)."
        )(command)
        return click.option(
            "--workload",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=default_workload,
            show_default=True,
            help="Workload file with the trace task to run.",
        )(command)

    return add


@click.command("overhead")
@trace_task_options(DEFAULT_WORKLOAD)
@click.option(
    "--rounds",
    default=3,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Rounds; each runs every mode once, in a rotated order.",
)
@click.option(
    "--inject-failure",
    is_flag=True,
    help="Also run each mode once per round with its sandbox SIGKILLed mid-trajectory.",
)
@click.option(
    "--fail-at",
    type=click.IntRange(1),
    default=None,
    help="Step at which the sandbox is killed [default: two thirds of the turns].",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.pass_context
def overhead(
    ctx: click.Context,
    workload: Path,
    task_id: str | None,
    rounds: int,
    inject_failure: bool,
    fail_at: int | None,
    as_json: bool,
) -> None:
    """Checkpoint overhead of none / every-step / adaptive / adaptive-model on the running
    stack, interleaved. adaptive is told each generation's length by the trace;
    adaptive-model predicts it from history, as on a model task.

    Policy settings other than the mode come from the configuration
    (e.g. BELAYER_POLICY__ALPHA); the stack must be up (`belayer up`).
    """

    config = config_from(ctx.find_root())
    task = load_trace_task(workload, task_id)
    err = Console(stderr=True)

    async def main() -> dict:
        client = await connect(config.temporal, config.storage.encryption_key)
        return await run_bench(
            stack_target(config, client),
            task,
            config.policy,
            rounds=rounds,
            inject=inject_failure,
            fail_at=fail_at,
            say=lambda m: err.print(m, highlight=False),
        )

    report_and_exit(asyncio.run(main()), as_json=as_json, print_table=print_report)
