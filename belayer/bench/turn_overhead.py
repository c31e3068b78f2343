"""`belayer bench turn-overhead`: what Belayer's turn loop costs beside the work of a turn.

One trace task runs, one trajectory at a time, two ways, `--repetitions` times with the
order rotated each repetition:

  belayer -- a `TrajectoryWorkflow` on the running stack (Temporal, the rollout node, the
             sandbox worker, the trajectory worker), checkpoint policy `none`: checkpoints
             are `belayer bench overhead`'s subject, this bench isolates the loop itself;
  plain   -- the loop written the obvious way: one asyncio program that drives a plain vLLM
             engine (the node engines' settings, `plain_engine.py`) and a sandbox of the same
             kind, created by `SandboxHost` and driven through its channel directly; no
             Temporal, no token log, no observation store, no checkpoints. It tokenizes each
             observation into its context, as any agent loop must.

The turn clocks run from the first generation request to the moment the next action
could start after the last turn (Belayer: the next activity is scheduled, the final check,
which the last observation's append runs beside; plain: the last observation is in the
context), so sandbox creation and the final check are outside them.
`orchestration_ms_per_turn` is the difference per turn (medians). Belayer's share is split
from the workflow's own history:

  dispatch        -- activity scheduled -> picked up by a worker (Temporal matching, polls);
  workflow_tasks  -- an activity's completion -> the next one scheduled (workflow task
                     rounds: scheduling, the worker's replay of the event, its decision,
                     and any context activity it runs locally);
  in_activities   -- activity time beyond the engine's work and the action's own duration:
                     the observation's append and the step record (inside `generate`),
                     object-store reads and writes of tokens, logprobs and the observation,
                     the sandbox channel;
  slower_work     -- the node's engine and the sandbox doing the turns' work more slowly
                     than the plain loop's engine and sandbox (the node runs its worker and
                     its shadow beside the engine): Belayer's cost too;
  other           -- the rest of the difference (it may be negative).

The report leads with the measured share: how much longer Belayer's turn is than the plain
loop's, in percent. What a trajectory costs outside its turns is measured on both sides
(`per_trajectory_s`): its start (Belayer: the workflow's start to its first generation,
the sandbox's creation included; plain: the sandbox's creation) and its finish (the final
check; Belayer: to the workflow's close).

What is simulated: nothing; the accelerator share is an estimate that assumes a 1-second
turn of work.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from temporalio.api.enums.v1 import EventType
from tokenizers import Tokenizer

from belayer.agent_format import OBSERVATION_TEMPLATE, PROMPT_TEMPLATE, observation_text
from belayer.bench.worker_recovery import PlainServer, plain_spec
from belayer.client import start_trajectory, trajectory_input
from belayer.contracts.generate import GENERATE, GenerateResult
from belayer.contracts.sandbox import EXEC, ExecResult
from belayer.measure import machine_load, rotated, spread
from belayer.model.build import model_path
from belayer.rollout.protocol import SamplingSpec
from belayer.sandbox import channel
from belayer.sandbox.host import make_host
from belayer.sandbox.models import Observation, SandboxSpec
from belayer.temporal_client import connect
from belayer.workloads.models import TraceTask

MODES = ("belayer", "plain")
DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "turn-overhead.yaml"
ACCELERATOR_TURN_S = 1.0
RUN_TIMEOUT_S = 600


# ---------------------------------------------------------------- Belayer's side


@dataclass
class ActivitySpan:
    """One activity of a workflow run, from its history (seconds since the epoch)."""

    name: str
    scheduled: float
    started: float
    completed: float
    work_s: float = 0.0  # the engine's or the action's own time inside it


@dataclass
class LoopSplit:
    """Belayer's turn loop, from one workflow history: the window and where it went."""

    turns: int
    loop_s: float
    dispatch_s: float
    workflow_tasks_s: float
    in_activities_s: float
    work_s: float
    start_s: float = 0.0  # the workflow's start to its first generation (sandbox creation)
    finish_s: float = 0.0  # the loop's end to the workflow's close (the final check)


def split_turn_loop(spans: list[ActivitySpan], turns: int) -> LoopSplit:
    """The window from the first `generate` scheduled to the first activity scheduled after
    the `turns`-th action (and its `append_observation`, when that ran as an activity of its
    own before anything else was scheduled, not locally inside a workflow task nor beside
    the final check), and its parts. Activities of the loop run one after another (policy
    `none`), so consecutive spans tile the window."""
    spans = sorted(spans, key=lambda s: s.scheduled)
    first = next(i for i, s in enumerate(spans) if s.name == GENERATE.name)
    actions = [i for i, s in enumerate(spans) if s.name == EXEC.name and i > first]
    if len(actions) < turns:
        raise click.ClickException(f"the workflow ran {len(actions)} actions, the trace has {turns} turns")
    last = actions[turns - 1]
    after = spans[last + 1 :]
    if (
        after
        and after[0].name == "append_observation"
        and all(s.scheduled >= after[0].completed for s in after[1:])
    ):
        last, after = last + 1, after[1:]
    following = next((s for s in after if s.name != "append_observation"), None)
    if following is None:
        raise click.ClickException("the workflow scheduled nothing after its last turn")
    loop = spans[first : last + 1]
    end = following.scheduled
    return LoopSplit(
        turns=turns,
        loop_s=end - loop[0].scheduled,
        dispatch_s=sum(s.started - s.scheduled for s in loop),
        workflow_tasks_s=sum(
            nxt.scheduled - s.completed for s, nxt in zip(loop, [*loop[1:], following], strict=True)
        ),
        in_activities_s=sum(s.completed - s.started - s.work_s for s in loop),
        work_s=sum(s.work_s for s in loop),
    )


async def activity_spans(client, history) -> list[ActivitySpan]:
    """Every activity's first scheduling, start and completion in the run's history, with
    the work it reports (the engine's time for `generate`, the action's for `sandbox.exec`)."""

    scheduled: dict[int, tuple[str, float]] = {}
    started: dict[int, float] = {}
    spans = []
    for event in history.events:
        at = event.event_time.ToDatetime().timestamp()
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled[event.event_id] = (
                event.activity_task_scheduled_event_attributes.activity_type.name,
                at,
            )
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started[event.activity_task_started_event_attributes.scheduled_event_id] = at
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            attrs = event.activity_task_completed_event_attributes
            name, when = scheduled[attrs.scheduled_event_id]
            span = ActivitySpan(name, when, started[attrs.scheduled_event_id], at)
            if name == GENERATE.name:
                (result,) = await client.data_converter.decode(attrs.result.payloads, [GenerateResult])
                span.work_s = max(result.timing.total_s - result.timing.queue_s, 0.0)
            elif name == EXEC.name:
                (result,) = await client.data_converter.decode(attrs.result.payloads, [ExecResult])
                span.work_s = result.observation.duration_s
            spans.append(span)
    return spans


async def run_belayer(config, client, task: TraceTask) -> LoopSplit:
    policy = config.policy.model_copy(update={"mode": "none"})
    started = trajectory_input(config, task).model_copy(
        update={"trajectory_id": f"bench-turns-{uuid.uuid4().hex[:8]}", "policy": policy}
    )
    handle = await start_trajectory(client, config, started)
    result = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    if result.status not in ("completed", "failed_policy"):
        raise click.ClickException(
            f"trajectory {result.trajectory_id} ended {result.status}: {result.reason}"
        )
    history = await handle.fetch_history()
    spans = await activity_spans(client, history)
    split = split_turn_loop(spans, len(task.turns))
    opened, closed = (
        event.event_time.ToDatetime().timestamp() for event in (history.events[0], history.events[-1])
    )
    first = min(s.scheduled for s in spans if s.name == GENERATE.name)
    split.start_s, split.finish_s = first - opened, closed - (first + split.loop_s)
    return split


# ---------------------------------------------------------------- the plain loop


def plain_exec(host, handle, trajectory: str, step: int, command: str) -> Observation:
    """The command through the sandbox's channel, as `SandboxHost.exec` runs it but
    without its lineage check (a plain loop has no recoveries to fence)."""

    reply = channel.run_action(
        host.backend.channel_path(handle.sandbox_id),
        trajectory=trajectory,
        step=step,
        generation=handle.generation,
        command=command,
        timeout_s=host.cfg.action_timeout_s,
        output_cap=host.cfg.output_cap_bytes,
    )
    return Observation.from_supervisor(reply["observation"], replayed=False)


@dataclass
class PlainRun:
    turns: int
    loop_s: float
    work_s: float
    start_s: float = 0.0  # the sandbox's creation and the prompt's tokens
    finish_s: float = 0.0  # the task's check


class PlainLoop:
    """The obvious agent loop: generate, run the command, tokenize the observation, repeat."""

    def __init__(self, config):
        model_dir = model_path(config.rollout.model)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.host = make_host(config, host_queue="belayer-bench-plain-loop")
        self.engine = PlainServer(plain_spec(config.rollout, model_dir))
        self.engine.start()

    def close(self) -> None:
        self.engine.close()

    async def _generate(self, context: list[int], max_tokens: int, seed: int) -> tuple[list[int], float]:
        spec = SamplingSpec(max_tokens=max_tokens, seed=seed, ignore_eos=True)
        t0 = time.monotonic()
        tokens = await asyncio.to_thread(self.engine.generate, uuid.uuid4().hex, context, spec)
        return tokens, time.monotonic() - t0

    async def run(self, task: TraceTask) -> PlainRun:
        def encode(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        trajectory = f"plain-{uuid.uuid4().hex[:8]}"
        opened = time.monotonic()
        handle = await asyncio.to_thread(self.host.create, SandboxSpec(setup_commands=task.setup))
        try:
            context = encode(PROMPT_TEMPLATE.format(instruction=f"replay trace {task.id}"))
            work = 0.0
            t0 = time.monotonic()
            for step, turn in enumerate(task.turns, start=1):
                generated, gen_s = await self._generate(context, turn.think_tokens, seed=step)
                self.tokenizer.decode(generated)
                context += generated
                observation = await asyncio.to_thread(
                    plain_exec, self.host, handle, trajectory, step, turn.bash
                )
                context += encode(OBSERVATION_TEMPLATE.format(body=observation_text(observation)))
                work += gen_s + observation.duration_s
            t1 = time.monotonic()
            if task.check:
                step = len(task.turns) + 1
                await asyncio.to_thread(plain_exec, self.host, handle, trajectory, step, task.check)
            return PlainRun(turns=len(task.turns), loop_s=t1 - t0, work_s=work, start_s=t0 - opened,
                            finish_s=time.monotonic() - t1)  # fmt: skip
        finally:
            await asyncio.to_thread(self.host.destroy, handle)


# ---------------------------------------------------------------- the benchmark


def schedule(repetitions: int) -> list[tuple[int, str]]:
    """(repetition, mode), the order rotated each repetition."""
    return rotated(MODES, repetitions)


def summarize(belayer: list[LoopSplit], plain: list[PlainRun], *, task: TraceTask, load: dict) -> dict:
    turns = len(task.turns)

    def per_turn_ms(values) -> dict:
        return spread([v / turns * 1000 for v in values])

    loop_b = per_turn_ms(s.loop_s for s in belayer)
    loop_p = per_turn_ms(r.loop_s for r in plain)
    overhead = loop_b["median"] - loop_p["median"]
    parts = {
        "dispatch_ms": per_turn_ms(s.dispatch_s for s in belayer),
        "workflow_tasks_ms": per_turn_ms(s.workflow_tasks_s for s in belayer),
        "in_activities_ms": per_turn_ms(s.in_activities_s for s in belayer),
    }
    work = {"belayer": per_turn_ms(s.work_s for s in belayer), "plain": per_turn_ms(r.work_s for r in plain)}
    # The node's engine and the sandbox doing the same work more slowly than the plain
    # loop's is Belayer's cost too (the node's settings, its worker beside the engine).
    slower_work = work["belayer"]["median"] - work["plain"]["median"]
    other = overhead - sum(p["median"] for p in parts.values()) - slower_work
    accelerator_ms = ACCELERATOR_TURN_S * 1000
    return {
        "bench": "turn-overhead",
        "orchestration_pct": round(overhead / loop_p["median"] * 100, 1) if loop_p["median"] else None,
        "orchestration_ms_per_turn": round(overhead, 1),
        "per_trajectory_s": {
            "belayer": _trajectory_s(belayer),
            "plain": _trajectory_s(plain),
        },
        "task": task.id,
        "turns": turns,
        "think_tokens_per_turn": round(statistics.mean(t.think_tokens for t in task.turns), 1),
        "repetitions": len(belayer),
        "accelerator_turn_pct": round(overhead / (accelerator_ms + overhead) * 100, 1),
        "belayer_turn_ms": loop_b,
        "plain_turn_ms": loop_p,
        "work_turn_ms": work,
        "split_ms_per_turn": {**parts, "slower_work_ms": round(slower_work, 1), "other_ms": round(other, 1)},
        "machine": load,
    }


def _trajectory_s(runs) -> dict:
    """What a trajectory costs outside its turns: its start (the sandbox's creation) and its
    finish (the final check), and both together."""
    return {
        "start_s": spread(r.start_s for r in runs),
        "finish_s": spread(r.finish_s for r in runs),
        "total_s": spread(r.start_s + r.finish_s for r in runs),
    }


async def run_bench(config, task: TraceTask, repetitions: int, say) -> dict:
    client = await connect(config.temporal, config.storage.encryption_key)
    say("starting the plain loop's engine (the rollout node's settings)")
    plain_loop = await asyncio.to_thread(PlainLoop, config)
    load = machine_load()
    belayer: list[LoopSplit] = []
    plain: list[PlainRun] = []
    try:
        await plain_loop.run(task)  # warm the plain engine's compiled paths, as the node's are
        for rep, mode in schedule(repetitions):
            if mode == "belayer":
                split = await run_belayer(config, client, task)
                belayer.append(split)
                loop_s = split.loop_s
            else:
                run = await plain_loop.run(task)
                plain.append(run)
                loop_s = run.loop_s
            say(
                f"repetition {rep + 1}/{repetitions} {mode:8s}: {len(task.turns)} turns in {loop_s:.2f}s "
                f"({loop_s / len(task.turns) * 1000:.0f} ms/turn)"
            )
    finally:
        await asyncio.to_thread(plain_loop.close)
    return summarize(belayer, plain, task=task, load=load | {"after": machine_load()["load_avg"]})


def print_report(report: dict) -> None:
    n = report["repetitions"]
    table = Table(
        title=f"turn loop, {report['turns']} turns of ~{report['think_tokens_per_turn']} tokens "
        f"(ms per turn; min / median / max of {n})"
    )
    for column in ("", "min", "median", "max"):
        table.add_column(column)

    def row(label: str, figures: dict) -> None:
        table.add_row(label, *(f"{figures[k]:.1f}" for k in ("min", "median", "max")))

    row("belayer", report["belayer_turn_ms"])
    row("plain loop", report["plain_turn_ms"])
    for name, figures in report["split_ms_per_turn"].items():
        if isinstance(figures, dict):
            row(f"  {name.removesuffix('_ms')}", figures)
    out = Console()
    out.print(
        f"Belayer's turn takes {report['orchestration_pct']}% longer than the plain loop's "
        f"({report['orchestration_ms_per_turn']} ms per turn)"
    )
    out.print(table)
    split = report["split_ms_per_turn"]
    out.print(
        f"of which the node's slower engine and sandbox work {split['slower_work_ms']} ms, other "
        f"{split['other_ms']} ms; on an accelerator's 1-second turn it would be "
        f"{report['accelerator_turn_pct']}% (estimated, not measured)"
    )
    per = report["per_trajectory_s"]
    out.print(
        f"per trajectory, outside its turns (start with the sandbox's creation, the final check): "
        f"Belayer {per['belayer']['total_s']['median']:.2f} s, plain {per['plain']['total_s']['median']:.2f} s"
    )
    machine = report["machine"]
    out.print(
        f"machine: {machine['cores']} cores, load average {machine['load_avg']} before, "
        f"{machine['after']} after"
    )
