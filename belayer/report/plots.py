"""The report's figures (matplotlib, Agg: no display needed), written as PNG files.

- timeline: one row per trajectory; generation, actions, checkpoints, recoveries as bars
  from the Temporal history; each fault a red line, its recovery a red band until the
  trajectory moved on;
- recovery: recovery time per fault kind (each fault a dot, the median a bar);
- outcomes: trajectories per verdict / status.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from belayer.report.data import RunData
from belayer.report.history import History

COLORS = {
    "generate": "#4C72B0",
    "action": "#55A868",
    "checkpoint": "#DD8452",
    "recover": "#8172B3",
    "setup": "#999999",
    "context": "#CCCCCC",
    "finish": "#64B5CD",
    "other": "#DDDDDD",
}
LANES = {"generate": 0.0, "context": 0.0, "setup": 0.0, "finish": 0.0, "other": 0.0,
         "action": 0.0, "checkpoint": -0.32, "recover": 0.32}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fault_time(fault, history: History | None) -> float | None:
    """When a fault hit: recorded by the soak, or (from `belayer run`) the end of its step's action."""
    if fault.injected_at is not None:
        return fault.injected_at
    if history is None or fault.at_step is None:
        return None
    actions = [i for i in history.intervals if i.kind == "action" and i.outcome == "completed"]
    return actions[fault.at_step - 1].end if 0 < fault.at_step <= len(actions) else None


def timeline(run: RunData, histories: dict[str, History], path: Path, max_rows: int = 40) -> Path | None:
    rows = [t for t in run.trajectories if histories.get(t.id) and histories[t.id].intervals][:max_rows]
    if not rows:
        return None
    plt = _pyplot()
    from matplotlib.patches import Patch

    origin = min(histories[t.id].start or 0 for t in rows)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.62 * len(rows)))
    faults_by_target: dict[str, list] = {}
    for fault in run.faults:
        faults_by_target.setdefault(fault.target, []).append(fault)
    for y, trajectory in enumerate(rows):
        history = histories[trajectory.id]
        for interval in history.intervals:
            lane = y + LANES.get(interval.kind, 0.0)
            height = 0.24 if interval.kind in ("checkpoint", "recover") else 0.36
            color = COLORS.get(interval.kind, COLORS["other"])
            failed = interval.outcome != "completed"
            if interval.start - interval.scheduled > 0.5:  # waited (retries, a worker down)
                ax.barh(lane, interval.start - interval.scheduled, left=interval.scheduled - origin,
                        height=height, color=color, alpha=0.25, linewidth=0)
            ax.barh(lane, max(interval.end - interval.start, 0.05), left=interval.start - origin, height=height,
                    color=color, edgecolor="black" if failed else color, hatch="//" if failed else None,
                    linewidth=0.6 if failed else 0)
        for index, fault in enumerate(faults_by_target.get(trajectory.id, [])):
            at = fault_time(fault, history)
            if at is None:
                continue
            ax.plot([at - origin] * 2, [y - 0.42, y + 0.42], color="#C44E52", linewidth=2)
            if fault.recovery_s:
                ax.fill_between([at - origin, at - origin + fault.recovery_s], y - 0.42, y + 0.42,
                                color="#C44E52", alpha=0.15, linewidth=0)
            # labels of faults close together on one row alternate between two lines
            ax.annotate(fault.kind, (at - origin, y + 0.42), xytext=(2, -1 - 8 * (index % 2)),
                        textcoords="offset points", fontsize=7, color="#C44E52", ha="left", va="top")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{t.id}  [{t.verdict or t.status}]" for t in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.7)
    ax.set_xlabel("seconds since the first trajectory started")
    ax.set_title("Trajectory timelines: turns, checkpoints, faults and recoveries")
    legend = [Patch(color=COLORS[k], label=k) for k in ("generate", "action", "checkpoint", "recover", "setup",
                                                         "finish")]
    legend += [Patch(color="#C44E52", alpha=0.5, label="fault → moving again"),
               Patch(facecolor="white", edgecolor="black", hatch="//", label="failed attempt")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.5 / max(1, len(rows)) - 0.06),
              ncol=8, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def recovery(run: RunData, path: Path) -> Path | None:
    measured = [f for f in run.faults if f.injected and f.recovery_s is not None]
    if not measured:
        return None
    plt = _pyplot()
    kinds = sorted({f.kind for f in measured})
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.55 * len(kinds)))
    for y, kind in enumerate(kinds):
        times = sorted(f.recovery_s for f in measured if f.kind == kind)
        median = statistics.median(times)
        ax.barh(y, median, height=0.6, color="#4C72B0", alpha=0.35)
        ax.scatter(times, [y] * len(times), color="#4C72B0", zorder=3, s=22)
        ax.annotate(f"median {median:.1f}s (n={len(times)})", (max(times), y), xytext=(6, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels(kinds)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from injection until the trajectory completed another step")
    ax.set_title("Recovery time per fault kind")
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(0, max(f.recovery_s for f in measured) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def outcomes(run: RunData, path: Path) -> Path | None:
    if not run.trajectories:
        return None
    plt = _pyplot()
    labels: dict[str, int] = {}
    names = {"ok": "ok (hashes identical)", "reference": "reference (no fault)",
             "context_cut": "context cut (consistent)"}
    for t in run.trajectories:
        key = names.get(t.verdict or t.status, t.verdict or t.status)
        labels[key] = labels.get(key, 0) + 1
    order = sorted(labels, key=lambda k: (not k.startswith(("ok", "completed", "reference")), k))
    colors = {names["ok"]: "#55A868", "completed": "#55A868", names["reference"]: "#999999",
              names["context_cut"]: "#DD8452"}
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(order)))
    ax.barh(order, [labels[k] for k in order], color=[colors.get(k, "#C44E52") for k in order])
    for y, key in enumerate(order):
        ax.annotate(str(labels[key]), (labels[key], y), xytext=(4, 0), textcoords="offset points", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("trajectories")
    ax.set_title("Outcome of every trajectory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
