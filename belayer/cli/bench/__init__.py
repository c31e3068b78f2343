"""`belayer bench`: the group of benchmark commands, each in a module of this package over
the benchmark of the same name in `belayer/bench/`."""

from __future__ import annotations

import click

from belayer.cli.bench.chaos import chaos
from belayer.cli.bench.checkpoint import checkpoint
from belayer.cli.bench.env_recovery import env_recovery
from belayer.cli.bench.fork import fork
from belayer.cli.bench.history import long_trajectory
from belayer.cli.bench.overhead import overhead
from belayer.cli.bench.publish import publish
from belayer.cli.bench.serve import serve
from belayer.cli.bench.storage import storage
from belayer.cli.bench.suite import suite
from belayer.cli.bench.training import training
from belayer.cli.bench.turn_overhead import turn_overhead
from belayer.cli.bench.turn_throughput import turn_throughput
from belayer.cli.bench.worker_recovery import worker_recovery


@click.group()
def bench() -> None:
    """Benchmarks that measure Belayer and its baseline side by side in one run."""


for command in (
    storage,
    env_recovery,
    checkpoint,
    worker_recovery,
    publish,
    overhead,
    chaos,
    long_trajectory,
    training,
    fork,
    turn_overhead,
    turn_throughput,
    serve,
    suite,
):
    bench.add_command(command)
