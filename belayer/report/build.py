"""Assemble a report: read the input, fetch histories (run and soak reports only), draw,
write the page."""

from __future__ import annotations

from pathlib import Path

from belayer.report import html, plots
from belayer.report.data import (
    ReportError,
    RunData,
    TrainingRun,
    control_warnings,
    load_bench,
    load_input,
    load_training,
)
from belayer.report.history import History, fetch_histories

REWARD_CAPTION = (
    "Mean reward over the kept groups' trajectories (train) and over the held-out tasks (never trained on), "
    "per iteration; iteration 0 is rolled out on the start weights. {control}"
)
TIME_PANEL_CAPTION = (
    "The right panel puts the same points at the wall minute each iteration ended, so time lost to faults "
    "stretches the curve sideways."
)
TIME_CAPTION = (
    "Seconds each iteration spent rolling out its groups, taking the optimizer step and publishing the new "
    "weights into the engines (stacked: they run one after the other). Recovery is the time recoveries "
    "lost, summed over the iteration's trajectories: they run side by side, so it can exceed the rollout "
    "time and is drawn as a red stem beside the bar, not as a slice of it. Faults injected are named above the "
    "iteration they hit."
)


async def build_report(
    run_json: Path, out_dir: Path, benches: list[Path], config=None, control_json: Path | None = None
) -> Path:
    """Write `out_dir/report.html` (figures embedded) and the figures as PNG files; `config`
    None means no Temporal history (the timeline is then left out). A training result is
    reported from its JSON alone, optionally against `control_json`."""
    run = load_input(run_json)
    bench_docs = [(path.name, load_bench(path)) for path in benches]
    if isinstance(run, TrainingRun):
        control = load_training(control_json, role="control") if control_json is not None else None
        return _training_report(run, control, out_dir, bench_docs)
    if control_json is not None:
        raise ReportError(
            f"--control compares training runs, but {run_json} is a `belayer {_command(run)}` "
            "result; give a `belayer train --json` result first"
        )
    return await _run_report(run, out_dir, bench_docs, config)


async def _run_report(run: RunData, out_dir: Path, bench_docs: list[tuple[str, dict]], config) -> Path:
    histories: dict[str, History] = {}
    if config is not None and run.trajectories:
        histories = await fetch_histories(config, [t.id for t in run.trajectories])
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = []
    for title, draw, name in [
        ("Timeline", lambda p: plots.timeline(run, histories, p), "timeline.png"),
        ("Recovery time per fault kind", lambda p: plots.recovery(run, p), "recovery.png"),
        ("Outcomes", lambda p: plots.outcomes(run, p), "outcomes.png"),
    ]:
        drawn = draw(out_dir / name)
        if drawn is not None:
            figures.append((title, drawn))
    errors = {k: h.error for k, h in histories.items() if h.error}
    page = out_dir / "report.html"
    page.write_text(html.page(run, figures, bench_docs, errors))
    return page


def _training_report(
    run: TrainingRun, control: TrainingRun | None, out_dir: Path, bench_docs: list[tuple[str, dict]]
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    compared = f"The dashed lines are the control run ({control.label}). " if control is not None else ""
    reward_caption = REWARD_CAPTION.format(control=compared)
    if plots.has_time_panel(run, control):
        reward_caption += TIME_PANEL_CAPTION
    figures = []
    for title, drawn, caption in [
        ("Reward", plots.reward_curve(run, control, out_dir / "reward.png"), reward_caption),
        ("Time per iteration", plots.time_split(run, out_dir / "time.png"), TIME_CAPTION),
    ]:
        if drawn is not None:
            figures.append((title, drawn, caption))
    warnings = control_warnings(run, control) if control is not None else []
    page = out_dir / "report.html"
    page.write_text(html.training_page(run, control, figures, bench_docs, warnings))
    return page


def _command(run: RunData) -> str:
    return "bench chaos --json" if run.kind == "soak" else "run --json"
