"""`belayer bench turn-throughput`: the control plane's CPU per turn, and the turns per
second it sustains, at 1, 16 and 64 concurrent trajectories.

The figure that decides how far Belayer scales is not a turn's latency (Temporal's round
trips set a floor there, issue 16) but what a turn costs the machines that run the control
plane: CPU. Trivial turns (a few generated tokens, `echo N` as the action) run two ways,
the order of the modes rotated each repetition:

  belayer -- trace trajectories on the running stack (`belayer up`): Temporal, SeaweedFS,
             the trajectory worker and the sandbox worker with its real sandboxes;
             checkpoint policy `none` (checkpoints are `belayer bench overhead`'s subject);
  plain   -- the same turns in one asyncio program: sandboxes created by `SandboxHost` on
             this host and driven through their channel, each observation tokenized into
             the context; no Temporal, no object store, no token log.

Simulated: the engine. In both modes the tokens come from the scripted engine
(`belayer.testing.ScriptedRollout`, on a queue of the bench's own process for Belayer), so
no model forward pass is measured; for Belayer that process does the rollout node's
non-engine work of a turn (the observation appended, the tokens written to the token log,
heartbeats) and is charged as `bench`.

Each trajectory count runs at two lengths (`--turns SHORT,LONG`). Per turn is the long run
less the short one, divided by the turns added (concurrency x (LONG - SHORT)): starting
the workflows, creating the sandboxes and the final checks are in both and cancel out;
they are reported per trajectory (the short run less its turns). CPU is read from /proc
by `belayer.bench.cpu_ledger` and split by process: each stack service with its children,
podman and its runtimes (`podman`), the sandboxes' monitors (`conmon`) and everything in
the sandboxes (`in-sandbox`: the supervisor and the actions), this process (`bench`).
Services a turn does not touch (the rollout node behind the scripted engine, the trainer),
other processes and kernel threads are shown beside the total, not in it.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.table import Table
from temporalio.worker import Worker
from tokenizers import Tokenizer

from belayer.agent_format import OBSERVATION_TEMPLATE, PROMPT_TEMPLATE, observation_text
from belayer.bench.cpu_ledger import CpuLedger
from belayer.bench.turn_overhead import plain_exec
from belayer.client import start_trajectory, trajectory_input
from belayer.measure import goals, machine_load, rotated, spread
from belayer.model.build import model_path
from belayer.policy.config import PolicyConfig
from belayer.sandbox.host import make_host
from belayer.sandbox.models import SandboxSpec
from belayer.stack.local import LocalStack
from belayer.storage.store import open_store
from belayer.temporal_client import connect
from belayer.testing import ScriptedRollout, scripted_token
from belayer.workloads.models import TraceTask, TraceTurn

MODES = ("belayer", "plain")
CONCURRENCY = (1, 16, 64)
TURNS = (2, 8)
THINK_TOKENS = 4
GOAL_CPU_MS_PER_TURN = 10.0
# Processes whose names say they are podman or the runtimes it runs, wherever they hang.
PODMAN_NAMES = ("podman", "runc", "crun", "criu", "catatonit", "slirp4netns", "netavark", "aardvark-dns")
# The turn's own processes, by mode; every other group is shown beside the total.
TOUCHED = {
    "belayer": (
        "temporal",
        "seaweedfs",
        "trajectory-worker",
        "sandbox-worker",
        "bench",
        "podman",
        "conmon",
        "in-sandbox",
    ),
    "plain": ("bench", "podman", "conmon", "in-sandbox"),
}


def throughput_task(turns: int) -> TraceTask:
    return TraceTask(
        id=f"throughput-{turns}",
        turns=[TraceTurn(think_tokens=THINK_TOKENS, bash=f"echo {n}") for n in range(1, turns + 1)],
    )


# ---------------------------------------------------------------- the two loops


async def run_belayer(client, config, engine_queue: str, task: TraceTask, concurrency: int) -> list[str]:
    """`concurrency` trajectories of `task` at once on the stack; their statuses."""
    run_id = uuid.uuid4().hex[:6]
    inputs = []
    for member in range(concurrency):
        input = trajectory_input(config, task, repeat=member, seed=member, run_id=run_id)
        inputs.append(input.model_copy(update={
            "policy": PolicyConfig(mode="none"),
            "queues": input.queues.model_copy(update={"rollout": engine_queue}),
        }))  # fmt: skip
    handles = await asyncio.gather(*(start_trajectory(client, config, input) for input in inputs))
    return [result.status for result in await asyncio.gather(*(handle.result() for handle in handles))]


class PlainLoop:
    """The obvious agent loop, `concurrency` trajectories at once: the scripted engine's
    tokens, the command through the sandbox's channel, the observation tokenized."""

    def __init__(self, config, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.host = make_host(config, host_queue="belayer-bench-throughput-plain")

    async def run(self, task: TraceTask, concurrency: int) -> list[str]:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:  # one blocking call per trajectory
            return await asyncio.gather(
                *(self._trajectory(task, member, pool) for member in range(concurrency))
            )

    async def _trajectory(self, task: TraceTask, seed: int, pool) -> str:
        loop = asyncio.get_running_loop()

        def encode(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        trajectory = f"plain-{uuid.uuid4().hex[:8]}"
        handle = await loop.run_in_executor(pool, self.host.create, SandboxSpec(setup_commands=task.setup))
        try:
            context = encode(PROMPT_TEMPLATE.format(instruction=f"replay trace {task.id}"))
            vocab = self.tokenizer.get_vocab_size()
            for step, turn in enumerate(task.turns, start=1):
                generated = [scripted_token(seed, len(context) + i, vocab) for i in range(turn.think_tokens)]
                self.tokenizer.decode(generated)
                context += generated
                observation = await loop.run_in_executor(
                    pool, plain_exec, self.host, handle, trajectory, step, turn.bash
                )
                context += encode(OBSERVATION_TEMPLATE.format(body=observation_text(observation)))
            return "completed"
        finally:
            await loop.run_in_executor(pool, self.host.destroy, handle)


# ---------------------------------------------------------------- CPU, by process


def group_processes(processes: dict[int, dict], services: dict[int, str], me: int) -> dict[str, float]:
    """CPU seconds by group (see the module's docstring) of a `CpuLedger` window."""
    groups: dict[str, float] = {}
    for pid, row in processes.items():
        if row["cpu_s"]:
            group = _group_of(pid, processes, services, me)
            groups[group] = groups.get(group, 0.0) + row["cpu_s"]
    return {group: round(cpu_s, 3) for group, cpu_s in sorted(groups.items())}


def _group_of(pid: int, processes: dict[int, dict], services: dict[int, str], me: int) -> str:
    if processes[pid]["name"] in PODMAN_NAMES:
        return "podman"
    ancestor, below_conmon = pid, False
    while ancestor in processes:
        if ancestor == 2 or processes[ancestor]["parent"] == 2:
            return "kernel"
        if processes[ancestor]["name"] == "conmon":
            return "in-sandbox" if below_conmon else "conmon"
        if ancestor == me:
            return "bench"
        if ancestor in services:
            return services[ancestor]
        below_conmon = True
        ancestor = processes[ancestor]["parent"]
    return "other"


def _service_group(name: str) -> str:
    """A stack service's group: numbered copies (`sandbox-worker.1`) join their first."""
    return name.split(".")[0]


# ---------------------------------------------------------------- the benchmark


async def run_bench(config, *, concurrency: tuple[int, ...], turns: tuple[int, int], repetitions: int,
                    say) -> dict:  # fmt: skip
    client = await connect(config.temporal, config.storage.encryption_key)
    services = {row.pid: _service_group(row.name) for row in LocalStack(config).status() if row.pid}
    tokenizer_path = model_path(config.rollout.model, config.cache_dir) / "tokenizer.json"
    engine_queue = f"belayer-bench-throughput-{uuid.uuid4().hex[:6]}"
    engine = ScriptedRollout(
        open_store(config.storage, encrypted=False), tokenizer_path, node_queue=engine_queue
    )
    plain = PlainLoop(config, Tokenizer.from_file(str(tokenizer_path)))
    tasks = {length: throughput_task(length) for length in turns}
    load = machine_load()
    windows: list[dict] = []
    worker = Worker(client, task_queue=engine_queue, activities=[engine.generate, engine.context.append_observation],
                    max_concurrent_activities=max(concurrency))  # fmt: skip
    async with worker:
        await run_belayer(client, config, engine_queue, tasks[turns[0]], 1)  # warm: imports, caches
        await plain.run(tasks[turns[0]], 1)
        for rep, mode in rotated(MODES, repetitions):
            for count in concurrency:
                for length in turns:
                    runner = (
                        run_belayer(client, config, engine_queue, tasks[length], count)
                        if mode == "belayer"
                        else plain.run(tasks[length], count)
                    )
                    with CpuLedger() as ledger:
                        statuses = await runner
                    cpu = group_processes(ledger.processes, services, os.getpid())
                    windows.append({"repetition": rep, "mode": mode, "concurrency": count, "turns": length,
                                    "wall_s": round(ledger.wall_s, 3), "cpu_s": cpu,
                                    "statuses": {s: statuses.count(s) for s in sorted(set(statuses))}})  # fmt: skip
                    say(
                        f"repetition {rep + 1}/{repetitions} {mode:8s} {count:3d} x {length:2d} turns: "
                        f"{ledger.wall_s:6.1f} s, {sum(cpu.get(g, 0) for g in TOUCHED[mode]):6.1f} CPU-s"
                    )
    return summarize(windows, concurrency=concurrency, turns=turns, repetitions=repetitions) | {
        "machine": load | {"after": machine_load()["load_avg"]}
    }


def summarize(windows: list[dict], *, concurrency, turns: tuple[int, int], repetitions: int) -> dict:
    short, long = turns
    runs = {}
    for count in concurrency:
        added = count * (long - short)
        per_mode = {}
        for mode in MODES:
            pairs = [(_window(windows, rep, mode, count, short), _window(windows, rep, mode, count, long))
                     for rep in range(repetitions)]  # fmt: skip
            per_mode[mode] = _marginal(pairs, mode, count, short, added)
        belayer, plain = per_mode["belayer"], per_mode["plain"]
        runs[str(count)] = per_mode | {
            "cpu_ratio_vs_plain": _ratio(_median(belayer["cpu_ms_per_turn"]), _median(plain["cpu_ms_per_turn"])),
            "turns_per_s_ratio_vs_plain": _ratio(_median(belayer["turns_per_s"]), _median(plain["turns_per_s"])),
        }  # fmt: skip
    top = runs[str(max(concurrency))]["belayer"]
    cpu_ms = top["cpu_ms_per_turn"]["median"]
    failed = sorted({status for w in windows for status in w["statuses"] if status != "completed"})
    return {
        "bench": "turn-throughput",
        "concurrency": max(concurrency),
        "cpu_ms_per_turn": cpu_ms,
        "turns_per_s": _median(top["turns_per_s"]),
        **goals(
            {
                f"cpu_ms_per_turn <= {GOAL_CPU_MS_PER_TURN:g} at {max(concurrency)} concurrent trajectories": cpu_ms
                <= GOAL_CPU_MS_PER_TURN,
                "every trajectory completed": not failed,
            }
        ),  # fmt: skip
        "control_plane_turns_per_s_per_core": round(1000 / cpu_ms, 1) if cpu_ms > 0 else None,
        "turns": list(turns),
        "think_tokens_per_turn": THINK_TOKENS,
        "repetitions": repetitions,
        "not_completed": failed,
        "runs": runs,
        "simulated": "the engine: scripted tokens, no model forward pass (its non-engine work is the bench "
        "process's, charged as `bench`)",
        "windows": windows,
    }


def _window(windows, rep, mode, count, length) -> dict:
    return next(w for w in windows if (w["repetition"], w["mode"], w["concurrency"], w["turns"]) ==
                (rep, mode, count, length))  # fmt: skip


def _marginal(pairs: list[tuple[dict, dict]], mode: str, count: int, short: int, added: int) -> dict:
    """Per turn: the long run less the short one over the turns it added; per trajectory:
    the short run less its turns."""

    def touched(window) -> float:
        return sum(window["cpu_s"].get(group, 0.0) for group in TOUCHED[mode])

    per_turn = [(touched(b) - touched(a)) / added * 1000 for a, b in pairs]
    groups = sorted({g for a, b in pairs for g in (*a["cpu_s"], *b["cpu_s"])})
    by_process = {
        g: spread([(b["cpu_s"].get(g, 0.0) - a["cpu_s"].get(g, 0.0)) / added * 1000 for a, b in pairs], digits=2)
        for g in groups
    }  # fmt: skip
    return {
        "cpu_ms_per_turn": spread(per_turn, digits=2),
        "turns_per_s": spread(
            [added / (b["wall_s"] - a["wall_s"]) if b["wall_s"] > a["wall_s"] else None for a, b in pairs],
            digits=1,
        ),  # fmt: skip
        "cpu_ms_per_turn_by_process": {g: v for g, v in by_process.items() if g in TOUCHED[mode]},
        "not_in_total_ms_per_turn": {g: v for g, v in by_process.items() if g not in TOUCHED[mode]},
        "per_trajectory_cpu_ms": spread(
            [
                (touched(a) * 1000 - short * count * turn_ms) / count
                for (a, _), turn_ms in zip(pairs, per_turn, strict=True)
            ],
            digits=1,
        ),  # fmt: skip
    }


def _median(figures: dict | None) -> float | None:
    """A spread's median; None where nothing was measured (two runs of one wall time)."""
    return figures["median"] if figures is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def print_report(report: dict) -> None:
    n = report["repetitions"]
    table = Table(title=f"control-plane CPU per turn (ms; median of {n}; {report['turns']} turns)")
    for column in ("trajectories", "mode", "CPU ms/turn", "turns/s", "CPU ms/trajectory", "largest parts"):
        table.add_column(column)
    for count, modes in report["runs"].items():
        for mode in MODES:
            run = modes[mode]
            parts = sorted(run["cpu_ms_per_turn_by_process"].items(), key=lambda kv: -kv[1]["median"])[:4]
            table.add_row(
                count,
                mode,
                f"{run['cpu_ms_per_turn']['median']:.1f}",
                f"{_median(run['turns_per_s'])}",
                f"{run['per_trajectory_cpu_ms']['median']:.0f}",
                ", ".join(f"{g} {v['median']:.1f}" for g, v in parts),
            )
    out = Console()
    out.print(table)
    for goal, met in report["goals"].items():
        out.print(f"goal {goal}: {'met' if met else 'NOT MET'}")
    out.print(f"simulated: {report['simulated']}")
