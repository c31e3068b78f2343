"""`belayer report RUN_JSON --out DIR`: a self-contained HTML report with PNG figures, on a
run, a soak or a training run."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import click

from belayer.cli.context import config_from
from belayer.report.build import build_report


@click.command()
@click.argument("run_json", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory for report.html and the PNG figures (created).",
)
@click.option(
    "--bench",
    "benches",
    multiple=True,
    type=click.Path(path_type=Path),
    help="A `belayer bench ... --json` result to show side by side (repeatable).",
)
@click.option(
    "--history/--no-history",
    default=True,
    show_default=True,
    help="Read each trajectory's Temporal history for the timeline (run and soak reports).",
)
@click.option(
    "--control",
    "control_json",
    type=click.Path(path_type=Path),
    default=None,
    help="A `belayer train --json` result to draw dashed beside a training run (typically lr 0).",
)
@click.pass_context
def report(
    ctx: click.Context,
    run_json: Path,
    out_dir: Path,
    benches: tuple[Path, ...],
    history: bool,
    control_json: Path | None,
) -> None:
    """Report on RUN_JSON (from `belayer run --json` or `belayer bench chaos --json`): a timeline
    per trajectory (turns, checkpoints, faults, recoveries), recovery times per fault kind,
    the outcome of every trajectory, and benchmark tables side by side.

    From `belayer train --json`: the reward curve (train and held-out, beside a --control run),
    where each iteration's time went, the faults and their recovery, and every iteration's
    reward and weights. A training report reads only the JSON (no server needed).
    """

    config = config_from(ctx.find_root()) if history else None
    path = asyncio.run(build_report(run_json, out_dir, list(benches), config, control_json))
    click.echo(str(path))
    sys.stdout.flush()
    os._exit(0)  # the Temporal SDK can abort at interpreter exit (docs/design.md §7)
