"""`belayer bench all --out DIR`: every benchmark, one after another, as a user runs each.

Each benchmark runs as its own `belayer bench NAME --json` process (its defaults, plus
`--repetitions` or `--rounds` where it takes them: 3 unless told), its JSON kept as
`DIR/NAME.json` and its progress lines as `DIR/NAME.log`. `chaos` keeps its own
`--rounds` (5): its rounds are its repetitions, and a soak of fewer would not inject
every fault kind (two faults a round, nine kinds). Then, from those files alone:

  DIR/summary.json   -- per benchmark: the command, whether it succeeded, its wall time;
                        and the machine (cores, load average) before and after the suite;
  DIR/benchmarks.md  -- every figure each benchmark reports as min / median / max (and its
                        single-valued figures), the commands, the machine: the page
                        `docs/benchmarks.md` is copied from;
  DIR/plots.html     -- one page: per benchmark, its min / median / max figures as bars
                        (also DIR/NAME.png).

A benchmark that fails is recorded with the end of its log and the suite goes on; one
that printed its report and failed its own verdict (a chaos soak that lost a trajectory)
keeps its figures beside the failure. The command exits 1 when any failed. Nothing here
judges a figure.
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from belayer.report import plots
from belayer.report.html import document, figure


@dataclass(frozen=True)
class Bench:
    name: str
    args: tuple[str, ...] = ()
    repetitions_option: str | None = "--repetitions"
    stack: bool = True  # needs `belayer up`


# In the order they run: the short ones first, so a broken stack shows early.
BENCHES = (
    Bench("storage", stack=False),
    Bench("turn-overhead"),
    Bench("turn-throughput"),
    Bench("serve", repetitions_option="--sessions"),  # a repetition: one conversation of --calls calls
    Bench("fork"),
    Bench("checkpoint", stack=False),
    Bench("env-recovery", stack=False),
    Bench("overhead", repetitions_option="--rounds"),
    Bench("worker-recovery"),
    Bench("publish"),
    Bench("chaos", repetitions_option=None),  # its default --rounds are its repetitions
    Bench("long-trajectory"),
    Bench("training"),
)
TAIL_LINES = 30
SHORT_TEXT = 200  # a report's texts up to this long are shown on the page (longer: the JSON)


@dataclass
class Outcome:
    name: str
    command: list[str]
    ok: bool
    wall_s: float
    error: str = ""
    report: dict = field(default_factory=dict)


def command_of(bench: Bench, repetitions: int | None) -> list[str]:
    argv = ["belayer", "bench", bench.name, *bench.args, "--json"]
    if repetitions is not None and bench.repetitions_option:
        argv += [bench.repetitions_option, str(repetitions)]
    return argv


def run_one(bench: Bench, out_dir: Path, repetitions: int | None) -> Outcome:
    """`belayer bench NAME --json` in a process of its own; stdout is its JSON."""
    command = command_of(bench, repetitions)
    log = out_dir / f"{bench.name}.log"
    started = time.monotonic()
    with log.open("w") as stderr:
        done = subprocess.run(
            [sys.executable, "-m", "belayer.cli", *command[1:]],
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
        )
    wall_s = round(time.monotonic() - started, 1)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = None
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:])
    if not isinstance(report, dict):
        return Outcome(bench.name, command, False, wall_s, error=f"exit {done.returncode}:\n{tail}")
    # A report with a failing exit is the benchmark's own verdict (a chaos soak that lost a
    # trajectory): its figures are kept beside the failure, not thrown away with it.
    (out_dir / f"{bench.name}.json").write_text(json.dumps(report, indent=2))
    if done.returncode != 0:
        return Outcome(
            bench.name,
            command,
            False,
            wall_s,
            report=report,
            error=f"exit {done.returncode}: its own verdict failed (see {bench.name}.json):\n{tail}",
        )
    return Outcome(bench.name, command, True, wall_s, report=report)


def selected(only: tuple[str, ...], skip: tuple[str, ...]) -> list[Bench]:
    known = {b.name for b in BENCHES}
    unknown = sorted((set(only) | set(skip)) - known)
    if unknown:
        raise click.UsageError(
            f"no benchmark named {', '.join(unknown)}; the suite has {', '.join(sorted(known))}"
        )
    return [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]


# ---------------------------------------------------------------- what the files say


def is_spread(value) -> bool:
    return (
        isinstance(value, dict)
        and {"min", "median", "max"} <= value.keys()
        and all(isinstance(value[k], (int, float)) for k in ("min", "median", "max"))
    )


def is_named_rows(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(row, dict) and isinstance(row.get("name"), str) for row in value)
    )


def figures(
    report: dict, prefix: str = "", depth: int = 8
) -> tuple[list[tuple[str, dict]], list[tuple[str, object]]]:
    """The report's min / median / max figures and its single values (numbers, verdicts,
    short texts such as a goal or what was simulated), by dotted path, however deeply
    nested (lists of per-run records are left to the JSON file; a list of named rows, such
    as env-recovery's workloads, is read as a dict by name)."""
    spreads: list[tuple[str, dict]] = []
    numbers: list[tuple[str, object]] = []
    for key, value in report.items():
        path = f"{prefix}{key}"
        if key == "machine":
            continue
        if is_named_rows(value):
            value = {row["name"]: {k: v for k, v in row.items() if k != "name"} for row in value}
        if is_spread(value):
            spreads.append((path, value))
        elif isinstance(value, dict) and depth > 1:
            inner_spreads, inner_numbers = figures(value, f"{path}.", depth - 1)
            spreads += inner_spreads
            numbers += inner_numbers
        elif isinstance(value, (int, float)) or (isinstance(value, str) and len(value) <= SHORT_TEXT):
            numbers.append((path, value))
    return spreads, numbers


def markdown(outcomes: list[Outcome], machine: dict) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"From one `belayer bench all` run on {machine['cores']} cores; load average (1 / 5 / 15 min) "
        f"{_loads(machine['before'])} before and {_loads(machine['after'])} after. Each benchmark measures "
        "Belayer and its baseline side by side; its own section of the README says what it compares and "
        "what is simulated. Figures of repeated runs are min / median / max.",
        "",
    ]
    if described := machine.get("description"):
        lines[2:2] = [
            f"Machine: {described['cpu']}, {described['cores']} cores, {described['memory_gib']} GiB, "
            f"Linux {described['kernel']}, {described['os']}; Belayer {described['commit']}.",
            "",
        ]
    for outcome in outcomes:
        lines += [f"## {outcome.name}", "", f"`{' '.join(outcome.command)}` ({outcome.wall_s:.0f} s)", ""]
        if not outcome.ok:
            lines += ["Failed:", "", "```", outcome.error, "```", ""]
        spreads, numbers = figures(outcome.report)
        if spreads:
            lines += ["| figure | median | min | max |", "|---|---|---|---|"]
            lines += [
                f"| {p} | {_num(s['median'])} | {_num(s['min'])} | {_num(s['max'])} |" for p, s in spreads
            ]
            lines.append("")
        if numbers:
            lines += ["| figure | value |", "|---|---|"]
            lines += [f"| {p} | {_num(v)} |" for p, v in numbers]
            lines.append("")
    return "\n".join(lines)


def plots_page(outcomes: list[Outcome], machine: dict, out_dir: Path) -> str:
    """One HTML page (the report's layout), a chart per benchmark of its min / median / max
    figures, each also kept as `out_dir/NAME.png`."""

    parts = [
        f"<h1>Belayer benchmarks</h1><p>{machine['cores']} cores; load average "
        f"{html.escape(_loads(machine['before']))} before, {html.escape(_loads(machine['after']))} after.</p>"
    ]
    for outcome in outcomes:
        spreads = figures(outcome.report)[0]
        command = f"<p><code>{html.escape(' '.join(outcome.command))}</code></p>"
        failed = [] if outcome.ok else ["<p>failed; see its log</p>"]
        if spreads:
            parts += [
                figure(outcome.name, plots.spreads(spreads, out_dir / f"{outcome.name}.png")),
                command,
                *failed,
            ]
            continue
        why = "failed; see its log" if not outcome.ok else "no repeated figures (see the JSON)"
        parts += [f"<h2>{html.escape(outcome.name)}</h2>", command, f"<p>{why}</p>"]
    return document("Belayer benchmarks", parts)


def _num(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _loads(loads: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in loads)


# ---------------------------------------------------------------- the files it writes


def write_outputs(out_dir: Path, outcomes: list[Outcome], machine: dict) -> None:
    summary = {
        "machine": machine,
        "benchmarks": [
            {
                "name": o.name,
                "command": " ".join(o.command),
                "ok": o.ok,
                "wall_s": o.wall_s,
                "error": o.error or None,
            }
            for o in outcomes
        ],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "benchmarks.md").write_text(markdown(outcomes, machine))
    (out_dir / "plots.html").write_text(plots_page(outcomes, machine, out_dir))
