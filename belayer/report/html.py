"""One self-contained HTML page: figures embedded as base64 PNG, tables inline, no
scripts, no network fetches -- it opens the same offline, in a mail, or from CI artefacts."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from belayer.report.data import RunData, TrainingRun

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4}.bad{color:#b00;font-weight:600}.good{color:#070;font-weight:600}
.side{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}.side>div{flex:1 1 420px;overflow-x:auto}
img{max-width:100%}code{font-size:12px}
.caption{font-size:13px;color:#555;max-width:1000px}.warn{background:#fff4d6;border:1px solid #e0b84c;padding:6px 10px}
"""
HEADLINE = [
    "trajectories",
    "faults_injected",
    "lost",
    "mismatched",
    "failed_infra",
    "context_cuts",
    "p50_recovery_s",
    "p99_recovery_s",
    "faults_not_injected",
    "seed",
    "rounds",
    "wall_s",
]
ZERO_IS_GOOD = {"lost", "mismatched", "failed_infra"}


def page(
    run: RunData,
    figures: list[tuple[str, Path]],
    benches: list[tuple[str, dict]],
    history_errors: dict[str, str],
) -> str:
    parts = [f"<h1>Belayer report — {html.escape(Path(run.source).name)}</h1>", _summary(run)]
    parts += [figure(title, path) for title, path in figures]
    parts.append(_faults(run))
    parts.append(_trajectories(run))
    parts.append(_benches(benches))
    if history_errors:
        parts.append(
            "<h2>Histories not read</h2><ul>"
            + "".join(
                f"<li><code>{html.escape(k)}</code>: {html.escape(v)}</li>" for k, v in history_errors.items()
            )
            + "</ul>"
        )
    return document("Belayer report", parts)


def training_page(
    run: TrainingRun,
    control: TrainingRun | None,
    figures: list[tuple[str, Path, str]],
    benches: list[tuple[str, dict]],
    warnings: list[str],
) -> str:
    parts = [f"<h1>Belayer training report — run <code>{html.escape(run.run_id)}</code></h1>"]
    parts += [f"<p class='warn'>warning: {html.escape(w)}</p>" for w in warnings]
    parts.append(_training_summary(run, control))
    if not run.iterations:
        parts.append("<p>The run recorded no iteration: nothing to draw.</p>")
    parts += [figure(*drawn) for drawn in figures]
    parts.append(_training_faults(run))
    parts.append(_iterations(run))
    parts.append(_trainer_metrics(run))
    parts.append(_dropped_groups(run))
    parts.append(_benches(benches))
    return document(f"Belayer training report — {run.run_id}", parts)


def document(title: str, parts: list[str]) -> str:
    head = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>"
    )
    return "\n".join([head, *[p for p in parts if p], "</body></html>"])


def figure(title: str, path: Path, caption: str = "") -> str:
    encoded = base64.b64encode(path.read_bytes()).decode()
    text = f"<p class='caption'>{html.escape(caption)}</p>" if caption else ""
    return (
        f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
        f"src='data:image/png;base64,{encoded}'>{text}"
    )


def _benches(benches: list[tuple[str, dict]]) -> str:
    if not benches:
        return ""
    boxes = "".join(
        f"<div><h3>{html.escape(name)}</h3>{_bench(document)}</div>" for name, document in benches
    )
    return f"<h2>Benchmarks, side by side</h2><div class='side'>{boxes}</div>"


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
        table += _table(
            ["fault kind", "injected", "p50 recovery s", "max recovery s"],
            [
                [k, v.get("injected"), v.get("p50_recovery_s"), v.get("max_recovery_s")]
                for k, v in by_kind.items()
            ],
        )
    return "<h2>Summary</h2><div class='side'><div>" + table + "</div></div>"


def _faults(run: RunData) -> str:
    if not run.faults:
        return ""
    rows = [
        [f.kind, f.target, f.at_step, "yes" if f.injected else "no", f.recovery_s, f.recovered_by]
        for f in run.faults
    ]
    return "<h2>Faults</h2>" + _table(
        ["kind", "trajectory", "at step", "injected", "recovery s", "recovered by"], rows
    )


def _trajectories(run: RunData) -> str:
    rows = []
    for t in run.trajectories:
        recoveries = "; ".join(
            f"step {r.get('step')}: {r.get('source')}, replayed {r.get('replayed_steps')}"
            + (f", cut after {r['cut_after_step']}" if r.get("cut_after_step") else "")
            for r in t.recoveries
        )
        rows.append([t.id, t.task, t.status, t.verdict, t.turns, recoveries or "-"])
    return "<h2>Trajectories</h2>" + _table(["id", "task", "status", "verdict", "turns", "recoveries"], rows)


def _training_summary(run: TrainingRun, control: TrainingRun | None) -> str:
    planned = run.settings.get("iterations")
    rows = [
        ("run id", run.run_id, ""),
        ("status", run.status, {"completed": "good", "failed_infra": "bad"}.get(run.status, "")),
        ("reason", run.reason, ""),
        ("iterations recorded", f"{len(run.iterations)}" + (f" of {planned}" if planned else ""), ""),
        ("train reward, first → last", _first_to_last(run, "mean_reward"), ""),
        ("held-out reward, first → last", _first_to_last(run, "heldout_reward"), ""),
    ]
    if any(i.mean_actions_per_trajectory is not None for i in run.iterations):
        rows.append(
            ("actions per trajectory, first → last", _first_to_last(run, "mean_actions_per_trajectory"), "")
        )
    if control is not None:
        rows += [
            ("control", f"run {control.run_id} ({control.status}), {control.label}", ""),
            ("control train reward, first → last", _first_to_last(control, "mean_reward"), ""),
            ("control held-out reward, first → last", _first_to_last(control, "heldout_reward"), ""),
        ]
    if run.iterations and run.iterations[-1].elapsed_s is not None:
        rows.append(("wall time", _duration(run.iterations[-1].elapsed_s), ""))
    if run.faults:
        injected = [f for f in run.faults if f.injected]
        recovered = sum(f.recovery_s is not None for f in injected)
        rows.append(
            ("faults", f"{len(injected)} injected of {len(run.faults)} planned, {recovered} recovered", "")
        )
    body = "".join(
        f"<tr><th>{html.escape(key)}</th><td{f' class={css!r}' if css else ''}>"
        f"{html.escape(str(value))}</td></tr>"
        for key, value, css in rows
        if value != ""
    )
    body += f"<tr><th>final weights sha256</th><td><code>{html.escape(run.final_weights_sha256 or '-')}</code></td></tr>"
    settings = (
        _table(["setting", "value"], list(run.settings.items()))
        if run.settings
        else "<p>(no settings recorded)</p>"
    )
    return (
        f"<h2>Summary</h2><div class='side'><div><table>{body}</table></div>"
        f"<div><h3>Settings</h3>{settings}</div></div>"
    )


def _first_to_last(run: TrainingRun, field: str) -> str:
    """First and last recorded values and the change: the curve in one line."""
    values = [(i.iteration, getattr(i, field)) for i in run.iterations if getattr(i, field) is not None]
    if not values:
        return "-"
    (first_at, first), (last_at, last) = values[0], values[-1]
    return f"{first:.3f} (iteration {first_at}) → {last:.3f} (iteration {last_at}), {last - first:+.3f}"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m {rest:02d}s" if minutes else f"{rest}s"


def _training_faults(run: TrainingRun) -> str:
    if not run.faults:
        return ""
    rows = [[f.kind, f.at, f.target, f.recovered_by, f.recovery_s] for f in run.faults]
    return "<h2>Faults</h2>" + _table(["kind", "iteration", "target", "recovered by", "recovery s"], rows)


def _iterations(run: TrainingRun) -> str:
    if not run.iterations:
        return ""
    rows = [
        [
            i.iteration,
            _reward(i.mean_reward),
            _reward(i.heldout_reward),
            _duration(i.elapsed_s) if i.elapsed_s is not None else None,
            i.groups_kept,
            i.groups_dropped,
            i.infra_retries,
            f"v{i.weights_version} {i.weights_sha256[:12]}",
            None if i.engine_logprob_drift is None else f"{i.engine_logprob_drift:.1e}",
            None if i.mean_actions_per_trajectory is None else f"{i.mean_actions_per_trajectory:.2f}",
        ]
        for i in run.iterations
    ]
    return "<h2>Iterations</h2>" + _table(
        [
            "iteration",
            "train reward",
            "held-out reward",
            "elapsed",
            "groups kept",
            "groups dropped",
            "infra retries",
            "weights (version, sha256)",
            "engine logprob drift",
            "actions per trajectory",
        ],
        rows,
    )


def _trainer_metrics(run: TrainingRun) -> str:
    """What the trainer saw each iteration, and the reward of each task family: the
    numbers people read in TensorBoard (`belayer train --logdir`), for a run that reports them."""
    if all(i.entropy is None and i.grad_norm is None for i in run.iterations):
        return ""
    families = sorted({f for i in run.iterations for f in i.rewards_by_family})

    def shown(value: float | None, spec: str) -> str | None:
        return None if value is None else format(value, spec)

    rows = [
        [
            i.iteration,
            shown(i.loss, ".4f"),
            shown(i.kl, ".2e"),
            shown(i.clip_fraction, ".3f"),
            shown(i.entropy, ".3f"),
            shown(i.grad_norm, ".3f"),
            shown(i.lr, ".2e"),
            shown(i.response_tokens, ".1f"),
            *(_reward(i.rewards_by_family.get(f)) for f in families),
        ]
        for i in run.iterations
    ]
    header = ["iteration", "loss", "KL", "clip fraction", "entropy", "grad norm", "lr", "response tokens"]
    return "<h2>Trainer</h2>" + _table(header + [f"reward: {f}" for f in families], rows)


def _reward(value: float | None) -> str | None:
    """Three decimals always, so a column of rewards lines up."""
    return None if value is None else f"{value:.3f}"


def _dropped_groups(run: TrainingRun) -> str:
    rows = [[i.iteration, d.get("group"), d.get("reason")] for i in run.iterations for d in i.dropped]
    return "<h2>Dropped groups</h2>" + _table(["iteration", "group", "why"], rows) if rows else ""


def _bench(document: dict) -> str:
    """Top-level scalars as one table; each list of objects as a table of its scalar columns."""
    scalars = [[k, v] for k, v in document.items() if not isinstance(v, (dict, list))]
    out = _table(["field", "value"], scalars) if scalars else ""
    for key, value in document.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = [c for c in value[0] if not isinstance(value[0][c], (dict, list))]
            out += f"<h4>{html.escape(key)}</h4>" + _table(
                columns, [[row.get(c) for c in columns] for row in value]
            )
        elif isinstance(value, dict):
            flat = [[k, v] for k, v in value.items() if not isinstance(v, (dict, list))]
            if flat:
                out += f"<h4>{html.escape(key)}</h4>" + _table(["field", "value"], flat)
    return out or "<p>(no tabular fields)</p>"


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value and abs(value) < 1e-3:
        return f"{value:g}"  # a learning rate: three decimals would print 0
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    text = str(value)
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
        return text[:12] + "…"  # a sha256: the prefix tells runs apart
    return text
