"""`belayer bench chaos`: the chaos soak (belayer/chaos/soak.py) as a command.

It injects real faults into the stack of the effective configuration: run it against a
stack of your own (`BELAYER_STATE_DIR=... belayer up` on other ports), never one that
other people's runs share, with the settings (`BELAYER_*` environment, `--config`) the
stack was started with: a node or host it brings back starts with this command's
configuration. Its `--rounds` are its repetitions: recovery seconds (per
fault kind and over all) and each round's wall time come as min / median / max
(`*_spread`), beside the soak's nearest-rank p50 / p99.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from belayer.chaos.faults import ChaosError
from belayer.chaos.soak import SOAK_FAULT_KINDS, Soak, SoakSettings, default_kinds
from belayer.cli.context import config_from
from belayer.measure import machine_load, spread_cells
from belayer.report.build import build_report
from belayer.stack.local import LocalStack

console = Console(stderr=True)
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "workloads" / "build-and-serve.yaml"


@click.command()
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    help="Workload file (repeatable); default examples/workloads/build-and-serve.yaml.",
)
@click.option(
    "--rounds",
    default=5,
    show_default=True,
    type=click.IntRange(1, 10_000),
    help="Rounds with faults, after one reference round.",
)
@click.option(
    "--repeats",
    default=1,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Trajectories per task per round.",
)
@click.option(
    "--group-size",
    default=0,
    show_default=True,
    type=click.IntRange(0, 256),
    help="Also run each task as a group of this many members forked from one set-up (0: no groups).",
)
@click.option("--faults-per-round", default=2, show_default=True, type=click.IntRange(0, 1000))
@click.option(
    "--extra-rounds",
    default=2,
    show_default=True,
    type=click.IntRange(0, 1000),
    help="Rounds added, while any are left, for faults whose round ended before they found a target.",
)
@click.option(
    "--seed", default=0, show_default=True, type=click.IntRange(0), help="Seed of the fault schedule."
)
@click.option(
    "--kinds",
    default=None,
    metavar="KIND,...",
    help="Fault kinds drawn from (default: all the stack can take; drain needs two sandbox hosts). "
    f"Kinds: {', '.join(SOAK_FAULT_KINDS)}.",
)
@click.option("--s3-outage-s", default=3.0, show_default=True, type=click.FloatRange(0, 600))
@click.option(
    "--round-timeout-s",
    default=600.0,
    show_default=True,
    type=click.FloatRange(10, 86400),
    help="A trajectory without a result by then counts as lost (and is terminated).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with per-run details).")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write the JSON here (input of `belayer report`).",
)
@click.option(
    "--report",
    "report_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write the HTML report (`belayer report`) into this directory.",
)
@click.pass_context
def chaos(
    ctx: click.Context,
    workloads: tuple[Path, ...],
    rounds: int,
    repeats: int,
    group_size: int,
    faults_per_round: int,
    extra_rounds: int,
    seed: int,
    kinds: str | None,
    s3_outage_s: float,
    round_timeout_s: float,
    as_json: bool,
    out: Path | None,
    report_dir: Path | None,
) -> None:
    """Soak: the example workloads under a seeded schedule of real faults of every kind;
    each trajectory's token and environment hashes compared with an unfailed run.

    Besides the process faults of `belayer chaos`, `terminate` ends a trajectory from
    Temporal (its host's reaper must remove its sandbox) and `drain` drains its sandbox's
    host (every sandbox there moves to another; the host then comes back).

    Exit status 1 when a trajectory was lost, mismatched or failed_infra, or something leaked.
    """

    config = config_from(ctx.find_root())
    chosen = chosen_kinds(kinds, LocalStack(config).sandbox_hosts)
    settings = SoakSettings(
        workloads=list(workloads) or [EXAMPLE],
        rounds=rounds,
        repeats=repeats,
        group_size=group_size,
        faults_per_round=faults_per_round,
        extra_rounds=extra_rounds,
        seed=seed,
        kinds=chosen,
        s3_outage_s=s3_outage_s,
        round_timeout_s=round_timeout_s,
    )
    # The Temporal SDK's core logs its connection retries (a restarted server) on stdout:
    # keep stdout for the JSON alone by sending fd 1 to stderr while the soak runs.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        summary = asyncio.run(
            Soak(config, settings, report=lambda m: console.print(m, highlight=False)).run()
        )
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    summary["machine"] = machine_load()
    text = json.dumps(summary, indent=2)
    if out:
        out.write_text(text)
    if report_dir:
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "soak.json").write_text(text)
        page = asyncio.run(build_report(report_dir / "soak.json", report_dir, [], config))
        console.print(f"report: {page}")
    if as_json:
        click.echo(text)
    else:
        print_report(summary)
    bad = (
        summary["lost"] or summary["mismatched"] or summary["failed_infra"] or any(summary["leaked"].values())
    )
    sys.stdout.flush()
    os._exit(1 if bad else 0)  # the Temporal SDK can abort at interpreter exit (docs/design.md §7)


def chosen_kinds(kinds: str | None, hosts: int) -> list[str]:
    """The fault kinds `--kinds` names (default: all a stack of `hosts` sandbox hosts can take)."""
    chosen = kinds.split(",") if kinds else default_kinds(hosts)
    unknown = [k for k in chosen if k not in SOAK_FAULT_KINDS]
    if unknown:
        raise ChaosError(
            f"unknown fault kind(s) {', '.join(unknown)}; choose from {', '.join(SOAK_FAULT_KINDS)}"
        )
    if "drain" in chosen and hosts < 2:
        raise ChaosError(
            "fault kind drain needs a second sandbox host to move sandboxes to: start the stack with "
            "`belayer up --sandbox-hosts 2`, or leave drain out of --kinds"
        )
    return chosen


def print_report(summary: dict) -> None:
    out = Console(width=max(Console().width, 120))
    table = Table(
        "fault kind",
        "injected",
        "min",
        "median",
        "max",
        title=f"recovery seconds over {summary['rounds_run']} rounds",
    )
    for kind, row in summary["by_kind"].items():
        table.add_row(kind, str(row["injected"]), *spread_cells(row["recovery_s_spread"]))
    table.add_row("all", str(summary["faults_injected"]), *spread_cells(summary["recovery_s_spread"]))
    out.print(table)
    out.print(
        f"{summary['trajectories']} trajectories, {summary['faults_injected']} faults: "
        f"lost {summary['lost']}, terminated by the soak {summary['terminated']}, mismatched {summary['mismatched']}, failed_infra {summary['failed_infra']}, "
        f"context cuts {summary['context_cuts']}; leaked {summary['leaked']}; recovery p50 "
        f"{_s(summary['p50_recovery_s'])} s, p99 {_s(summary['p99_recovery_s'])} s"
    )
    out.print(
        f"round wall time {' / '.join(spread_cells(summary['round_wall_s_spread']))} s (min / median / max)"
    )
    for run in summary.get("details", {}).get("runs", []):
        if run["verdict"] == "mismatched":
            out.print(f"mismatched {run['id']}: {run['parted']}", markup=False)


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f}"
