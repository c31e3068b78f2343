"""`belayer bench worker-recovery`: its options and output;
the benchmark itself is `belayer.bench.worker_recovery`."""

from __future__ import annotations

import json
import logging

import click

from belayer.bench.worker_recovery import QUICK, WEIGHT_MODES, Settings, print_report, run_bench
from belayer.measure import machine_load


@click.command("worker-recovery")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--quick",
    is_flag=True,
    help="Smoke run on the tiny model (64-token prompts, 32 new tokens, kill after 12) in a few minutes.",
)
@click.option("--model", type=click.Choice(["tiny", "bench"]), default=None, help="Default: bench.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option(
    "--weight-mode",
    "weight_modes",
    type=click.Choice(WEIGHT_MODES),
    multiple=True,
    help="Repeatable. Default: both (private is the headline).",
)
@click.option("--requests", type=click.IntRange(1, 256), default=4, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(1, 100_000), default=None, help="Default: 512.")
@click.option("--max-tokens", type=click.IntRange(2, 100_000), default=None, help="Default: 96.")
@click.option(
    "--kill-after",
    type=click.IntRange(1, 100_000),
    default=None,
    help="Tokens of request 0 before the kill. Default: 48.",
)
@click.option(
    "--repetitions",
    type=click.IntRange(1, 100),
    default=3,
    show_default=True,
    help="Faulted runs per side and mode.",
)
def worker_recovery(
    as_json, quick, model, dtype, weight_modes, requests, prompt_tokens, max_tokens, kill_after, repetitions
):
    """SIGKILL the engine mid-decode: Belayer's shadow takeover vs a plain vLLM restart.

    Both sides resume every in-flight request from its logged prefix and must produce the
    tokens of an unfailed run. Reports detection, serving, first new token and caught-up
    times (min/median/max over the repetitions, modes interleaved) and memory per engine.
    """
    given = {
        "model": model,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "kill_after": kill_after,
    }
    chosen = {k: v for k, v in given.items() if v is not None}
    settings = Settings(
        **{**(QUICK if quick else {}), **chosen},
        dtype=dtype,
        weight_modes=tuple(dict.fromkeys(weight_modes)) or WEIGHT_MODES,
        requests=requests,
        repetitions=repetitions,
    )
    if settings.kill_after >= settings.max_tokens:
        raise click.BadParameter("--kill-after must be below --max-tokens")

    def say(message: str) -> None:
        click.echo(f"[bench] {message}", err=True)

    logging.getLogger("belayer.rollout").setLevel(logging.WARNING)
    result = run_bench(settings, say) | {"machine": machine_load()}
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        print_report(result)
