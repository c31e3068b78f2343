"""What every command shares, at the bottom of the CLI layer: the effective configuration,
the error console, and how a command exits. Command modules import this, never
`cli.main`, which imports them all."""

from __future__ import annotations

import os
import sys

import click
from rich.console import Console

from belayer.config import BelayerConfig, load_config

console = Console(stderr=True)


def config_from(ctx: click.Context) -> BelayerConfig:
    """The effective configuration, loaded once per command."""
    if "config" not in ctx.obj:
        ctx.obj["config"] = load_config(ctx.obj.get("config_file"))
    return ctx.obj["config"]


def leave(code: int = 0):
    """Exit now, output flushed, skipping the interpreter's finalization: a command that
    used a Temporal client can otherwise abort there (exit 134, a known SDK issue;
    docs/design.md §7), turning a success into a failure for whoever waits on it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
