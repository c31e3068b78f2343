"""Assemble a report: read the run, fetch histories, draw, write the page."""

from __future__ import annotations

from pathlib import Path

from belayer.report import html, plots
from belayer.report.data import load_bench, load_run
from belayer.report.history import History, fetch_histories


async def build_report(run_json: Path, out_dir: Path, benches: list[Path], config=None) -> Path:
    """Write `out_dir/report.html` (figures embedded) and the figures as PNG files; `config`
    None means no Temporal history (the timeline is then left out)."""
    run = load_run(run_json)
    bench_docs = [(path.name, load_bench(path)) for path in benches]
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
