"""One self-contained HTML page: figures embedded as base64 PNG, tables inline, no
scripts, no network fetches -- it opens the same offline, in a mail, or from CI artefacts."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from belayer.report.data import RunData

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4}.bad{color:#b00;font-weight:600}.good{color:#070;font-weight:600}
.side{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}.side>div{flex:1 1 420px;overflow-x:auto}
img{max-width:100%}code{font-size:12px}
"""
HEADLINE = ["trajectories", "faults_injected", "lost", "mismatched", "failed_infra", "context_cuts",
            "p50_recovery_s", "p99_recovery_s", "faults_not_injected", "seed", "rounds", "wall_s"]
ZERO_IS_GOOD = {"lost", "mismatched", "failed_infra"}


def page(run: RunData, figures: list[tuple[str, Path]], benches: list[tuple[str, dict]],
         history_errors: dict[str, str]) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Belayer report</title>"
             f"<style>{STYLE}</style></head><body>",
             f"<h1>Belayer report — {html.escape(Path(run.source).name)}</h1>",
             _summary(run)]
    for title, path in figures:
        encoded = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
                     f"src='data:image/png;base64,{encoded}'>")
    parts.append(_faults(run))
    parts.append(_trajectories(run))
    if benches:
        parts.append("<h2>Benchmarks, side by side</h2><div class='side'>")
        for name, document in benches:
            parts.append(f"<div><h3>{html.escape(name)}</h3>{_bench(document)}</div>")
        parts.append("</div>")
    if history_errors:
        parts.append("<h2>Histories not read</h2><ul>" + "".join(
            f"<li><code>{html.escape(k)}</code>: {html.escape(v)}</li>" for k, v in history_errors.items()) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _summary(run: RunData) -> str:
    rows = []
    summary = run.summary
    for key in HEADLINE if run.kind == "soak" else list(summary):
        if key not in summary:
            continue
        value = summary[key]
        css = ""
        if key in ZERO_IS_GOOD:
            css = " class='good'" if value == 0 else " class='bad'"
        rows.append(f"<tr><th>{html.escape(key)}</th><td{css}>{html.escape(_fmt(value))}</td></tr>")
    leaked = summary.get("leaked")
    if isinstance(leaked, dict):
        css = " class='good'" if not any(leaked.values()) else " class='bad'"
        rows.append(f"<tr><th>leaked</th><td{css}>{html.escape(json.dumps(leaked))}</td></tr>")
    table = "<table>" + "".join(rows) + "</table>"
    by_kind = summary.get("by_kind")
    if isinstance(by_kind, dict) and by_kind:
        table += _table(["fault kind", "injected", "p50 recovery s", "max recovery s"],
                        [[k, v.get("injected"), v.get("p50_recovery_s"), v.get("max_recovery_s")]
                         for k, v in by_kind.items()])
    return "<h2>Summary</h2><div class='side'><div>" + table + "</div></div>"


def _faults(run: RunData) -> str:
    if not run.faults:
        return ""
    rows = [[f.kind, f.target, f.at_step, "yes" if f.injected else "no", f.recovery_s, f.recovered_by]
            for f in run.faults]
    return "<h2>Faults</h2>" + _table(["kind", "trajectory", "at step", "injected", "recovery s", "recovered by"],
                                      rows)


def _trajectories(run: RunData) -> str:
    rows = []
    for t in run.trajectories:
        recoveries = "; ".join(
            f"step {r.get('step')}: {r.get('source')}, replayed {r.get('replayed_steps')}"
            + (f", cut after {r['cut_after_step']}" if r.get("cut_after_step") else "")
            for r in t.recoveries)
        rows.append([t.id, t.task, t.status, t.verdict, t.turns, recoveries or "-"])
    return "<h2>Trajectories</h2>" + _table(["id", "task", "status", "verdict", "turns", "recoveries"], rows)


def _bench(document: dict) -> str:
    """Top-level scalars as one table; each list of objects as a table of its scalar columns."""
    scalars = [[k, v] for k, v in document.items() if not isinstance(v, (dict, list))]
    out = _table(["field", "value"], scalars) if scalars else ""
    for key, value in document.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = [c for c in value[0] if not isinstance(value[0][c], (dict, list))]
            out += f"<h4>{html.escape(key)}</h4>" + _table(columns, [[row.get(c) for c in columns] for row in value])
        elif isinstance(value, dict):
            flat = [[k, v] for k, v in value.items() if not isinstance(v, (dict, list))]
            if flat:
                out += f"<h4>{html.escape(key)}</h4>" + _table(["field", "value"], flat)
    return out or "<p>(no tabular fields)</p>"


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    text = str(value)
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
        return text[:12] + "…"  # a sha256: the prefix tells runs apart
    return text
