"""`belayer bench worker-recovery`: shadow takeover against an engine cold start.

One run, one node, the `bench` model: N requests with long prompts are decoding when the
leader is SIGKILLed. (a) Belayer takeover: the pre-initialized shadow takes the lease and
re-prefills every request from the node's log. (b) Cold start: the same kill, but the node
is told to start over (a new memory owner loads the weights from disk, a fresh engine
process starts) and then re-prefills the same requests. Both paths do the same re-prefill,
so two views are reported: ready (failure → serving again) and caught up (failure → every
request back at the token it had reached). Every request's final tokens are compared with
an uninterrupted run. With `--weight-modes` it also measures memory per engine and decode
throughput of both weight modes. The CLI owner registers `worker_recovery` under `bench`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import click

from belayer.workers.rollout.config import RolloutConfig
from belayer.workers.rollout.protocol import SamplingSpec

MB = 1 << 20


@dataclass
class _Run:
    """Progress of one faulted run: where each request was at the kill, when it got back."""

    kill_after: int
    killed_at: float | None = None
    at_kill: dict[int, int] = field(default_factory=dict)
    caught_up_at: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def workload(n: int, prompt_tokens: int, max_tokens: int, vocab: int) -> list[tuple[list[int], SamplingSpec]]:
    """Distinct deterministic prompts; half greedy, half seeded sampling."""
    out = []
    for i in range(n):
        prompt = [(7919 * (i + 1) + 104729 * j) % (vocab - 64) + 3 for j in range(prompt_tokens)]
        if i % 2 == 0:
            spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
        else:
            spec = SamplingSpec(
                max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True
            )
        out.append((prompt, spec))
    return out


def run_uninterrupted(node, requests) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    handles = [node.submit(p, s) for p, s in requests]
    tokens = [h.result(3600).token_ids for h in handles]
    return tokens, time.perf_counter() - t0


def run_faulted(node, requests, kill_after: int) -> tuple[list[list[int]], _Run]:
    """Kill the leader once request 0 has `kill_after` tokens; track catching up."""
    run = _Run(kill_after)

    def progress(i: int):
        def on_progress(n: int) -> None:
            now = time.monotonic()
            with run.lock:
                run.counts[i] = n
                if run.killed_at is None and i == 0 and n >= kill_after:
                    run.at_kill = dict(run.counts)
                    run.killed_at = time.monotonic()
                    os.kill(node.leader.pid, signal.SIGKILL)
                elif run.killed_at is not None and i not in run.caught_up_at and n >= run.at_kill.get(i, 0):
                    if now > run.killed_at:
                        run.caught_up_at[i] = now

        return on_progress

    handles = [node.submit(p, s, on_progress=progress(i)) for i, (p, s) in enumerate(requests)]
    tokens = [h.result(3600).token_ids for h in handles]
    return tokens, run


def resume_control(node, requests, expected: list[list[int]], at_kill: dict[int, int]) -> bool:
    """What plain vLLM does when it resumes a request from prompt + generated prefix, with no
    failure at all: in fp32 this matches the uninterrupted run; in bf16 it may not (KV rebuilt
    by prefill differs from KV built by decode), which is the yardstick for the takeover."""
    handles = []
    for i, (prompt, spec) in enumerate(requests):
        k = min(at_kill.get(i, 0), spec.max_tokens - 1)
        rest = SamplingSpec(**{**spec.__dict__, "max_tokens": spec.max_tokens - k})
        handles.append((k, node.submit(prompt + expected[i][:k], rest)))
    return all(h.result(3600).token_ids == expected[i][k:] for i, (k, h) in enumerate(handles))


def _first_divergence(expected: list[list[int]], got: list[list[int]]) -> list[int | None]:
    """Per request, the first position where the tokens differ (None when identical)."""
    out = []
    for a, b in zip(expected, got, strict=True):
        diff = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        out.append(diff if diff is not None or len(a) == len(b) else min(len(a), len(b)))
    return out


def _caught_up_s(run: _Run, event) -> float:
    # A request with 0 tokens at the kill is "caught up" once serving resumes.
    times = [run.caught_up_at.get(i, event.ready_at) for i in run.at_kill] or [event.ready_at]
    return max(max(times), event.ready_at) - run.killed_at


def measure_recovery(
    config: RolloutConfig, model_dir, requests: int, prompt_tokens: int, max_tokens: int, kill_after: int, say
) -> dict:
    from belayer.workers.rollout.node import RolloutNode

    node = RolloutNode(config, model_dir)
    say(f"starting node ({config.model}, {config.dtype}, weights {config.weight_mode})")
    t0 = time.perf_counter()
    node.start()
    start_s = time.perf_counter() - t0
    try:
        work = workload(requests, prompt_tokens, max_tokens, node.vocab_size)
        say(
            f"uninterrupted run: {requests} requests x {prompt_tokens} prompt tokens, {max_tokens} new tokens"
        )
        expected, base_s = run_uninterrupted(node, work)

        say(f"takeover run: SIGKILL the leader after {kill_after} tokens")
        before = len(node.recoveries)
        got_takeover, run_t = run_faulted(node, work, kill_after)
        takeover = node.recoveries[before]
        node.wait_shadow_ready()

        say("cold-start run: the same kill, the node starts over")
        node.force_full_cold_start_next("benchmark comparison point")
        before = len(node.recoveries)
        got_cold, run_c = run_faulted(node, work, kill_after)
        cold = node.recoveries[before]
        node.wait_shadow_ready()

        say("control: plain resume from prompt + prefix, no failure")
        control = resume_control(node, work, expected, run_t.at_kill)

        takeover_ready = takeover.ready_at - run_t.killed_at
        cold_ready = cold.ready_at - run_c.killed_at
        takeover_caught = _caught_up_s(run_t, takeover)
        cold_caught = _caught_up_s(run_c, cold)
        params = node.owner.ready.params
        generated = sum(len(t) for t in expected)
        return {
            "model": config.model,
            "model_params": params,
            "dtype": config.dtype,
            "weight_mode": config.weight_mode,
            "in_flight_requests": takeover.replayed_requests,
            "prefix_tokens": takeover.replayed_tokens,
            "tokens_at_kill": sum(run_t.at_kill.values()),
            "takeover_ready_s": round(takeover_ready, 4),
            "cold_start_ready_s": round(cold_ready, 4),
            "speedup": round(cold_ready / takeover_ready, 1),
            "takeover_caught_up_s": round(takeover_caught, 4),
            "cold_start_caught_up_s": round(cold_caught, 4),
            "speedup_caught_up": round(cold_caught / takeover_caught, 2),
            "tokens_identical": got_takeover == expected and got_cold == expected,
            "takeover_tokens_identical": got_takeover == expected,
            "cold_start_tokens_identical": got_cold == expected,
            "control_resume_identical": control,
            "first_divergence": _first_divergence(expected, got_takeover),
            "recovery_kinds": [takeover.kind, cold.kind],
            "phases": {
                "takeover": {k: round(v, 4) for k, v in takeover.phases.items()},
                "cold_start": {k: round(v, 4) for k, v in cold.phases.items()},
            },
            "node_start_s": round(start_s, 2),
            "uninterrupted_run_s": round(base_s, 2),
            "uninterrupted_tokens_per_s": round(generated / base_s, 1),
        }
    finally:
        node.close()


def measure_weight_mode(
    config: RolloutConfig, model_dir, requests: int, prompt_tokens: int, max_tokens: int, say
) -> dict:
    """Memory per engine and decode throughput of one weight mode (no fault)."""
    from belayer.workers.rollout.node import RolloutNode

    node = RolloutNode(config, model_dir)
    say(f"weight mode {config.weight_mode}: starting node")
    node.start()
    try:
        work = workload(requests, prompt_tokens, max_tokens, node.vocab_size)
        run_uninterrupted(node, work[:1])  # warm the leader's allocator and kernels
        tokens, wall = run_uninterrupted(node, work)
        single, single_wall = run_uninterrupted(node, work[:1])
        mem = node.memory()
        leader_rss, leader_private, leader_shared = mem["leader"]
        shadow = mem.get("shadow", (0, 0, 0))
        return {
            "engine_private_mb": round(leader_private / MB, 1),
            "engine_shared_mb": round(leader_shared / MB, 1),
            "engine_rss_mb": round(leader_rss / MB, 1),
            "idle_shadow_private_mb": round(shadow[1] / MB, 1),
            "owner_private_mb": round(mem["owner"][1] / MB, 1),
            "owner_shared_mb": round(mem["owner"][2] / MB, 1),
            "decode_tokens_per_s_batch": round(sum(len(t) for t in tokens) / wall, 1),
            "decode_tokens_per_s_single": round(len(single[0]) / single_wall, 1),
        }
    finally:
        node.close()


@click.command("worker-recovery")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--model", type=click.Choice(["tiny", "bench"]), default="bench", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option(
    "--weight-mode",
    type=click.Choice(["private", "shared"]),
    default=None,
    help="Default: the configured mode.",
)
@click.option("--requests", type=click.IntRange(1, 256), default=4, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(1, 100_000), default=512, show_default=True)
@click.option("--max-tokens", type=click.IntRange(2, 100_000), default=96, show_default=True)
@click.option(
    "--kill-after",
    type=click.IntRange(1, 100_000),
    default=48,
    show_default=True,
    help="Tokens of request 0 before the kill.",
)
@click.option(
    "--weight-modes", is_flag=True, help="Also measure memory and decode speed of both weight modes."
)
def worker_recovery(
    as_json, model, dtype, weight_mode, requests, prompt_tokens, max_tokens, kill_after, weight_modes
):
    """Kill the leader engine mid-decode: shadow takeover vs cold start."""
    from belayer.config import load_config
    from belayer.model.build import model_path

    if kill_after >= max_tokens:
        raise click.BadParameter("--kill-after must be below --max-tokens")
    cfg = load_config()
    say = (lambda _m: None) if as_json else (lambda m: click.echo(f"[bench] {m}", err=True))
    logging.getLogger("belayer.rollout").setLevel(logging.WARNING if as_json else logging.INFO)
    model_dir = model_path(model, cfg.cache_dir, progress=say)
    base = cfg.rollout.model_copy(
        update={
            "model": model,
            "dtype": dtype,
            "node_id": "bench-" + uuid.uuid4().hex[:6],
            "max_model_len": max(cfg.rollout.max_model_len, prompt_tokens + max_tokens + 1),
            "max_num_seqs": max(cfg.rollout.max_num_seqs, requests),
            "heartbeat_timeout_s": max(cfg.rollout.heartbeat_timeout_s, 30.0),  # long prefills on 2 cores
            "weights_verify_interval_s": 0,
            **({"weight_mode": weight_mode} if weight_mode else {}),
        }
    )
    kv_needed_mb = _kv_mb_needed(model_dir, dtype, requests * (prompt_tokens + max_tokens) * 2)
    base = base.model_copy(update={"kv_cache_mb": max(base.kv_cache_mb, kv_needed_mb)})
    result = measure_recovery(base, model_dir, requests, prompt_tokens, max_tokens, kill_after, say)
    if weight_modes:
        result["weight_modes"] = {
            mode: measure_weight_mode(
                base.model_copy(update={"weight_mode": mode, "node_id": "bench-" + uuid.uuid4().hex[:6]}),
                model_dir,
                requests,
                min(prompt_tokens, 128),
                max_tokens,
                say,
            )
            for mode in ("private", "shared")
        }
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        click.echo(f"{key:>28}: {value}")


def _kv_mb_needed(model_dir, dtype: str, tokens: int) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * head_dim
        * (4 if dtype == "float32" else 2)
    )
    return max(16, -(-tokens * per_token // MB) + 16)
