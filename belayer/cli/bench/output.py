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
    """Print the report; exit 1, naming the goal on stderr, when it says its goal was not
    met (`goal_met` false), else 0."""
    report.setdefault("machine", machine_load())
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
    sys.stdout.flush()
    missed = report.get("goal_met") is False
    if missed:
        click.echo(f"goal not met: {report.get('goal', '(unnamed)')}", err=True)
        sys.stderr.flush()
    os._exit(1 if missed else 0)
