"""How a benchmark command that talked to Temporal ends: its report on stdout, then an exit
without interpreter teardown, at which the Temporal SDK can abort (docs/design.md §7)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import click

from belayer.measure import machine_load


def report_and_exit(report: dict, *, as_json: bool, print_table: Callable[[dict], None]) -> None:
    """Print the report, then exit as `exit_status` says."""
    report.setdefault("machine", machine_load())
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
    sys.stdout.flush()
    status = exit_status(report)
    sys.stderr.flush()
    os._exit(status)


def exit_status(report: dict) -> int:
    """1 when the report's goals were not all met, each one missed named on stderr; else 0."""
    missed = [goal for goal, met in report.get("goals", {}).items() if not met]
    for goal in missed:
        click.echo(f"goal not met: {goal}", err=True)
    return 1 if missed else 0
