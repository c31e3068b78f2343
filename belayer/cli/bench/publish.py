"""`belayer bench publish`: its options and output; the benchmark itself is `belayer.bench.publish`."""

from __future__ import annotations

import json
import logging
import sys

import click

from belayer.bench.publish import QUICK, run_bench
from belayer.cli.bench.output import exit_status
from belayer.measure import machine_load


@click.command("publish")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--quick",
    is_flag=True,
    help="Smoke run on the tiny model (64-token prompts, 48 new tokens) in a few minutes.",
)
@click.option("--model", type=click.Choice(["tiny", "bench"]), default=None, help="Default: bench.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--weight-mode", type=click.Choice(["private", "shared"]), default="private", show_default=True)
@click.option(
    "--policy",
    type=click.Choice(["continue_on_new", "finish_on_old"]),
    default=None,
    help="In-flight policy. Default: the configured rollout.publish_policy.",
)
@click.option(
    "--requests",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    help="Requests decoding during the publish.",
)
@click.option("--prompt-tokens", type=click.IntRange(1, 100_000), default=None, help="Default: 128.")
@click.option("--max-tokens", type=click.IntRange(2, 100_000), default=None, help="Default: 96.")
@click.option(
    "--publish-after",
    type=click.IntRange(1, 100_000),
    default=None,
    help="Tokens of request 0 before the publish. Default: 16.",
)
@click.option(
    "--repetitions",
    type=click.IntRange(1, 100),
    default=3,
    show_default=True,
    help="Each publishes two versions: idle, then with requests in flight.",
)
def publish(
    as_json,
    quick,
    model,
    dtype,
    weight_mode,
    policy,
    requests,
    prompt_tokens,
    max_tokens,
    publish_after,
    repetitions,
):
    """Publish new weights in place vs restarting on a new file vs vLLM's reload_weights.

    Times run from the trainer handing over the new version until a first token is served
    on it; requests in flight during Belayer's publish must lose no token and every token
    must carry the version that made it.
    """
    given = {
        "model": model,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "publish_after": publish_after,
    }
    defaults = {"model": "bench", "prompt_tokens": 128, "max_tokens": 96, "publish_after": 16}
    settings = {
        **defaults,
        **(QUICK if quick else {}),
        **{k: v for k, v in given.items() if v is not None},
        "dtype": dtype,
        "weight_mode": weight_mode,
        "policy": policy,
        "requests": requests,
        "repetitions": repetitions,
    }
    if settings["publish_after"] >= settings["max_tokens"]:
        raise click.BadParameter("--publish-after must be below --max-tokens")

    def say(message: str) -> None:
        click.echo(f"[bench] {message}", err=True)

    logging.getLogger("belayer.rollout").setLevel(logging.WARNING)
    result = run_bench(settings, say) | {"machine": machine_load()}
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            if key not in ("runs", "simulated"):
                click.echo(f"{key:>32}: {value}")
        click.echo("simulated: " + "; ".join(result["simulated"]))
    sys.exit(exit_status(result))
