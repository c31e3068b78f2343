"""`belayer bench serve`: what an agent's model call costs through `belayer serve`, against
vLLM's own OpenAI server on the same model with the same engine settings.

Both sides answer the same agent-like conversations, one call at a time, interleaved call
by call with the order alternating: `--sessions` conversations of `--calls` calls each,
whose prompt grows by the last completion and a fixed observation every call (what an
agent sends back), `POST /v1/completions` with greedy decoding, `ignore_eos` and the same
`max_tokens`, so both sides generate the same number of tokens.

  belayer -- an agent session through the running stack's endpoint (`belayer up` starts
             `belayer serve` on stack.serve_port): Temporal, the rollout node (leader
             and shadow), the object store;
  vllm    -- `python -m vllm.entrypoints.openai.api_server` started here on the node's
             model with the node engines' settings (dtype, max_model_len, max_num_seqs, KV
             cache bytes, threads, prefix caching, eager mode), in its default process
             layout: what a user runs without Belayer.

The clock is the client's: from sending a request to having its whole answer, where an
agent stops waiting. Belayer's calls are split into the node's `generate` activity (its
attempt's own clock: the context read, the engine, the token log written; of it the
engine's prefill, queue included, and decode) and what is around it (the endpoint, the prompt stored, the update through Temporal, the workflow's
append of the prompt). A session's start (its workflow and token log; its sandbox is created
beside the first calls) is outside the calls' clocks and reported apart (`session_start_s`). What is simulated: the
observations (fixed text: the bench measures the model call, not the sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
from rich.console import Console
from rich.table import Table

from belayer.agent_format import OBSERVATION_TEMPLATE, render_chat
from belayer.errors import BelayerError
from belayer.measure import machine_load, spread
from belayer.model.build import model_path
from belayer.rollout.procutil import engine_environment
from belayer.serve.app import free_port
from belayer.workloads.models import ModelTask

SIDES = ("belayer", "vllm")
TASK = ModelTask(
    id="serve-bench",
    instruction="Read /workspace/notes.txt, summarise what it says in one line, and write the line to "
    "/workspace/summary.txt. Check the file afterwards and stop when it is right.",
    max_turns=1,
    max_tokens_per_turn=64,
    check="true",
)
OBSERVATION = OBSERVATION_TEMPLATE.format(body="notes: the build passed on the second try\n[exit 0]")
SERVER_READY_S = 600


@dataclass
class Conversation:
    """One side's view of a conversation: its prompt so far and each call's seconds; on
    Belayer's side also the node's `generate` activity and, of it, the engine's work."""

    prompt: str
    seconds: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)


class VllmServer:
    """vLLM's own OpenAI server on a free local port, stopped with its process group."""

    def __init__(self, config, log_path):
        rollout = config.rollout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        env = os.environ | engine_environment(rollout.engine_threads)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # vLLM's default layout, as users run it
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(model_path(rollout.model, config.cache_dir)), "--served-model-name", "plain",
                   "--dtype", rollout.dtype, "--enforce-eager", "--max-model-len", str(rollout.max_model_len),
                   "--max-num-seqs", str(rollout.max_num_seqs), "--kv-cache-memory-bytes",
                   str(rollout.kv_cache_mb << 20), "--seed", "0", "--enable-prefix-caching",
                   "--host", "127.0.0.1", "--port", str(self.port), "--disable-uvicorn-access-log",
                   "--uvicorn-log-level", "warning"]  # fmt: skip
        self.log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip

    async def wait_ready(self) -> float:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=5) as http:
            while time.monotonic() - started < SERVER_READY_S:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"vLLM's server exited with {self.process.returncode}; see {self.log.name}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/models")).status_code == 200:
                        return time.monotonic() - started
                await asyncio.sleep(0.5)
        raise RuntimeError(f"vLLM's server not ready after {SERVER_READY_S} s; see {self.log.name}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


async def run_bench(config, *, sessions_count: int, calls: int, max_tokens: int, say) -> dict:
    belayer_url = f"http://127.0.0.1:{config.stack.serve_port}/v1"
    async with httpx.AsyncClient(timeout=5) as http:
        try:
            (await http.get(f"{belayer_url}/models")).raise_for_status()
        except httpx.HTTPError as exc:
            raise BelayerError(
                f"the stack's endpoint {belayer_url} does not answer ({exc}): start it with `belayer up`"
            ) from None
    vllm = VllmServer(config, config.state_dir / "logs" / "bench-serve-vllm.log")
    try:
        say("starting vLLM's OpenAI server on the node's model (the node engines' settings)")
        vllm_start_s = await vllm.wait_ready()
        async with httpx.AsyncClient(timeout=600) as http:
            load = machine_load()
            await _call(
                http, f"{vllm.url}/completions", {}, "warm up", max_tokens, "plain"
            )  # as the node is, by `up`
            runs, starts = [], []
            for n in range(sessions_count):
                session_id, start_s = await _start_session(http, belayer_url)
                starts.append(start_s)
                prompt = render_chat([{"role": "user", "content": TASK.instruction}])
                sides = {side: Conversation(prompt) for side in SIDES}
                for k in range(calls):
                    order = SIDES if (n * calls + k) % 2 == 0 else SIDES[::-1]
                    for side in order:
                        url, headers = ((f"{belayer_url}/completions", {"X-Session-ID": session_id}) if side == "belayer"
                                        else (f"{vllm.url}/completions", {}))  # fmt: skip
                        await _turn(
                            http,
                            url,
                            headers,
                            sides[side],
                            max_tokens,
                            "plain" if side == "vllm" else config.rollout.model,
                        )
                say(f"conversation {n + 1}/{sessions_count}: {calls} calls each side, median "
                    f"{statistics.median(sides['belayer'].seconds) * 1000:.0f} ms belayer, "
                    f"{statistics.median(sides['vllm'].seconds) * 1000:.0f} ms vllm")  # fmt: skip
                runs.append(sides)
                with contextlib.suppress(httpx.HTTPError):
                    await http.post(f"{belayer_url}/sessions/{session_id}/finish")
    finally:
        await asyncio.to_thread(vllm.stop)
    return summarize(runs, starts, model=config.rollout.model, max_tokens=max_tokens, vllm_start_s=vllm_start_s,
                     load=load | {"after": machine_load()["load_avg"]})  # fmt: skip


async def _start_session(http: httpx.AsyncClient, url: str) -> tuple[str, float]:
    """A new session, once its sandbox and token log are there (outside the calls' clocks)."""
    started = time.perf_counter()
    answer = await http.post(
        f"{url}/sessions", json={"task": TASK.model_dump(mode="json"), "temperature": 0.0}
    )
    answer.raise_for_status()
    session_id = answer.json()["session_id"]
    while (await http.get(f"{url}/sessions/{session_id}")).json()[
        "context"
    ] is None:  # the sandbox comes first
        await asyncio.sleep(0.02)
    return session_id, time.perf_counter() - started


async def _turn(http, url: str, headers: dict, side: Conversation, max_tokens: int, model: str) -> None:
    answer, seconds = await _call(http, url, headers, side.prompt, max_tokens, model)
    side.seconds.append(seconds)
    if "belayer" in answer:
        timing = answer["belayer"]["timing"]
        side.generate_s.append(timing["total_s"])
        side.engine_s.append(
            timing["total_s"] - timing["queue_s"]
        )  # prefill (with the node's queue) and decode
    side.prompt += answer["choices"][0]["text"] + OBSERVATION


async def _call(
    http, url: str, headers: dict, prompt: str, max_tokens: int, model: str
) -> tuple[dict, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "add_special_tokens": False,  # as the node tokenizes a prompt: no BOS (vLLM's server adds one by default)
    }
    started = time.perf_counter()
    answer = await http.post(url, json=body, headers=headers)
    seconds = time.perf_counter() - started
    if answer.status_code != 200:
        raise RuntimeError(f"{url} answered {answer.status_code}: {answer.text[:500]}")
    return answer.json(), seconds


def summarize(runs: list[dict[str, Conversation]], starts: list[float], *, model: str, max_tokens: int,
              vllm_start_s: float, load: dict) -> dict:  # fmt: skip
    seconds = {side: [s for run in runs for s in run[side].seconds] for side in SIDES}
    medians = {side: statistics.median(values) for side, values in seconds.items()}
    ours = [run["belayer"] for run in runs]
    generate = [g for c in ours for g in c.generate_s]
    around = [s - g for c in ours for s, g in zip(c.seconds, c.generate_s, strict=True)]
    return {
        "overhead_ms_per_call": round((medians["belayer"] - medians["vllm"]) * 1000, 1),
        "ratio_belayer_to_vllm": round(medians["belayer"] / medians["vllm"], 3),
        "call_ms": {side: spread([s * 1000 for s in values], digits=1) for side, values in seconds.items()},
        "belayer_split_ms": {
            "generate_activity": spread([g * 1000 for g in generate], digits=1),
            "of_it_engine": spread([e * 1000 for c in ours for e in c.engine_s], digits=1),
            "around_it": spread([a * 1000 for a in around], digits=1),
        },
        "calls_per_side": len(seconds["belayer"]),
        "conversations": len(runs),
        "max_tokens": max_tokens,
        "model": model,
        "session_start_s": spread(starts),
        "vllm_server_start_s": round(vllm_start_s, 2),
        "simulated": "the observations (fixed text); the engines, the stack and both servers are real",
        "machine": load,
    }


def print_report(report: dict) -> None:
    out = Console()
    out.print(
        f"a model call through belayer serve takes {report['overhead_ms_per_call']} ms longer than through "
        f"vLLM's own OpenAI server (median of {report['calls_per_side']} calls each; "
        f"{report['ratio_belayer_to_vllm']}x)"
    )
    table = Table(title=f"{report['model']}, {report['max_tokens']} tokens per call (ms; min / median / max)")
    for column in ("", "min", "median", "max"):
        table.add_column(column)
    for side, figures in report["call_ms"].items():
        table.add_row(side, *(f"{figures[k]:.1f}" for k in ("min", "median", "max")))
    split = report["belayer_split_ms"]
    for label, key in (("  the node's generate activity", "generate_activity"), ("    of it the engine", "of_it_engine"),
                       ("  around it (endpoint, Temporal)", "around_it")):  # fmt: skip
        table.add_row(label, *(f"{split[key][k]:.1f}" for k in ("min", "median", "max")))
    out.print(table)
    out.print(f"session start (workflow, token log, sandbox), outside the calls: median "
              f"{report['session_start_s']['median']:.2f} s")  # fmt: skip
