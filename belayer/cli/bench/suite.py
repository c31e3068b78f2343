"""`belayer bench all`: its options and output; the suite itself is `belayer.bench.suite`."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from belayer.bench.suite import command_of, run_one, selected, write_outputs
from belayer.cli.context import config_from
from belayer.measure import machine_description, machine_load
from belayer.stack.local import LocalStack


def stack_problem(ctx: click.Context) -> str | None:
    """Why the stack cannot serve the benchmarks that need it, or None."""

    down = [row.name for row in LocalStack(config_from(ctx)).status() if not row.healthy]
    return f"not healthy: {', '.join(down)}; start the stack with `belayer up`" if down else None


@click.command("all")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for each benchmark's JSON and log, summary.json, benchmarks.md and plots.html.",
)
@click.option("--only", multiple=True, metavar="NAME", help="Run only this benchmark (repeatable).")
@click.option("--skip", multiple=True, metavar="NAME", help="Leave this benchmark out (repeatable).")
@click.option(
    "--repetitions",
    type=click.IntRange(1, 100),
    default=3,
    show_default=True,
    help="Repetitions (or rounds) of every benchmark that takes them.",
)
@click.pass_context
def suite(
    ctx: click.Context, out_dir: Path, only: tuple[str, ...], skip: tuple[str, ...], repetitions: int
) -> None:
    """Run every benchmark one after another and write their figures on one page.

    Takes an hour or more on a small machine. All but `storage`, `checkpoint` and
    `env-recovery` need the running stack (`belayer up`); it is checked before anything runs.
    """
    benches = selected(only, skip)
    if any(b.stack for b in benches) and (problem := stack_problem(ctx)):
        raise click.ClickException(f"the benchmarks need the running stack; {problem}")
    out_dir.mkdir(parents=True, exist_ok=True)
    err = Console(stderr=True)
    now = machine_load()
    machine = {"cores": now["cores"], "before": now["load_avg"], "description": machine_description()}
    outcomes = []
    for n, bench in enumerate(benches, start=1):
        err.print(
            f"[{n}/{len(benches)}] {' '.join(command_of(bench, repetitions))} "
            f"(progress in {out_dir / (bench.name + '.log')})",
            highlight=False,
        )
        outcome = run_one(bench, out_dir, repetitions)
        err.print(f"      {'done' if outcome.ok else 'FAILED'} in {outcome.wall_s:.0f} s", highlight=False)
        outcomes.append(outcome)
    machine["after"] = machine_load()["load_avg"]
    write_outputs(out_dir, outcomes, machine)
    failed = [o.name for o in outcomes if not o.ok]
    err.print(
        f"wrote {out_dir / 'benchmarks.md'} and {out_dir / 'plots.html'}"
        + (f"; failed: {', '.join(failed)} (see their logs)" if failed else ""),
        highlight=False,
    )
    sys.exit(1 if failed else 0)
