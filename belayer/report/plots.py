"""The report's figures (matplotlib, Agg: no display needed), written as PNG files.

- timeline: one row per trajectory; generation, actions, checkpoints, recoveries as bars
  from the Temporal history; each fault a red line, its recovery a red band until the
  trajectory moved on;
- recovery: recovery time per fault kind (each fault a dot, the median a bar);
- outcomes: trajectories per verdict / status;
- reward_curve (training): mean train and held-out reward per iteration, and against wall
  minutes; a control run dashed;
- time_split (training): rollout / train / publish seconds stacked per iteration, recovery
  time beside them, the faults injected named over their iteration.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from belayer.report.data import RunData, TrainingRun
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
LANES = {
    "generate": 0.0,
    "context": 0.0,
    "setup": 0.0,
    "finish": 0.0,
    "other": 0.0,
    "action": 0.0,
    "checkpoint": -0.32,
    "recover": 0.32,
}


def _pyplot():
    import matplotlib  # import cost: matplotlib, ~1 s

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # import cost: matplotlib, ~1 s

    return plt


def spreads(figures: list[tuple[str, dict]], path: Path) -> Path:
    """One benchmark's repeated figures (`belayer bench all`): each median a bar, its min and
    max the whisker; units are in the figures' names."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(figures) + 1))
    medians = [s["median"] for _, s in figures]
    errors = [[s["median"] - s["min"] for _, s in figures], [s["max"] - s["median"] for _, s in figures]]
    ax.barh(range(len(figures)), medians, xerr=errors, color=COLORS["generate"], ecolor="#333333", capsize=3)
    ax.set_yticks(range(len(figures)), [name for name, _ in figures], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median, whiskers min and max (units in each name)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    from matplotlib.patches import Patch  # import cost: matplotlib, ~1 s

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
                ax.barh(
                    lane,
                    interval.start - interval.scheduled,
                    left=interval.scheduled - origin,
                    height=height,
                    color=color,
                    alpha=0.25,
                    linewidth=0,
                )
            ax.barh(
                lane,
                max(interval.end - interval.start, 0.05),
                left=interval.start - origin,
                height=height,
                color=color,
                edgecolor="black" if failed else color,
                hatch="//" if failed else None,
                linewidth=0.6 if failed else 0,
            )
        for index, fault in enumerate(faults_by_target.get(trajectory.id, [])):
            at = fault_time(fault, history)
            if at is None:
                continue
            ax.plot([at - origin] * 2, [y - 0.42, y + 0.42], color="#C44E52", linewidth=2)
            if fault.recovery_s:
                ax.fill_between(
                    [at - origin, at - origin + fault.recovery_s],
                    y - 0.42,
                    y + 0.42,
                    color="#C44E52",
                    alpha=0.15,
                    linewidth=0,
                )
            # labels of faults close together on one row alternate between two lines
            ax.annotate(
                fault.kind,
                (at - origin, y + 0.42),
                xytext=(2, -1 - 8 * (index % 2)),
                textcoords="offset points",
                fontsize=7,
                color="#C44E52",
                ha="left",
                va="top",
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{t.id}  [{t.verdict or t.status}]" for t in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.7)
    ax.set_xlabel("seconds since the first trajectory started")
    ax.set_title("Trajectory timelines: turns, checkpoints, faults and recoveries")
    legend = [
        Patch(color=COLORS[k], label=k)
        for k in ("generate", "action", "checkpoint", "recover", "setup", "finish")
    ]
    legend += [
        Patch(color="#C44E52", alpha=0.5, label="fault → moving again"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="failed attempt"),
    ]
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.5 / max(1, len(rows)) - 0.06),
        ncol=8,
        fontsize=8,
        frameon=False,
    )
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
        ax.annotate(
            f"median {median:.1f}s (n={len(times)})",
            (max(times), y),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
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
    names = {
        "ok": "ok (hashes identical)",
        "reference": "reference (no fault)",
        "context_cut": "context cut (consistent)",
    }
    for t in run.trajectories:
        key = names.get(t.verdict or t.status, t.verdict or t.status)
        labels[key] = labels.get(key, 0) + 1
    order = sorted(labels, key=lambda k: (not k.startswith(("ok", "completed", "reference")), k))
    colors = {
        names["ok"]: "#55A868",
        "completed": "#55A868",
        names["reference"]: "#999999",
        names["context_cut"]: "#DD8452",
    }
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(order)))
    ax.barh(order, [labels[k] for k in order], color=[colors.get(k, "#C44E52") for k in order])
    for y, key in enumerate(order):
        ax.annotate(
            str(labels[key]), (labels[key], y), xytext=(4, 0), textcoords="offset points", va="center"
        )
    ax.invert_yaxis()
    ax.set_xlabel("trajectories")
    ax.set_title("Outcome of every trajectory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


TRAIN_COLOR, HELDOUT_COLOR = "#4C72B0", "#DD8452"
PHASE_COLORS = {"rollout": "#4C72B0", "train": "#55A868", "publish": "#DD8452"}
FAULT_COLOR = "#C44E52"
# the time figure's text at 8 points, in inches: what decides where fault names fit
INCHES_PER_CHAR, LINE_INCHES, BAR_LABEL_INCHES, AXES_INCHES = 0.065, 0.16, 0.2, 3.6


def reward_curve(run: TrainingRun, control: TrainingRun | None, path: Path) -> Path | None:
    """Left: reward per iteration. Right (when the runs recorded elapsed time): the same
    points against wall minutes, where time lost to faults shows as a stretched curve."""
    if not any(i.mean_reward is not None for i in run.iterations):
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator  # import cost: matplotlib, ~1 s

    runs = [(run, False)] + ([(control, True)] if control is not None else [])
    timed = has_time_panel(run, control)
    fig, axes = plt.subplots(
        1,
        2 if timed else 1,
        figsize=(13 if timed else 8, 4.6),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    by_iteration, by_time = axes[0][0], axes[0][-1] if timed else None
    for training, is_control in runs:
        _reward_lines(by_iteration, training, [i.iteration for i in training.iterations], is_control)
        if by_time is not None:
            _reward_lines(by_time, training, [i.elapsed_s / 60 for i in training.iterations], is_control)
    by_iteration.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_iteration.set_xlabel("iteration (0: the start weights)")
    by_iteration.set_ylabel("mean reward")
    by_iteration.set_title("per iteration")
    if by_time is not None:
        by_time.set_xlabel("wall minutes since the run started (at each iteration's end)")
        by_time.set_title("per wall minute")
        by_time.set_xlim(left=0)
    rewards = [
        value
        for training, _ in runs
        for i in training.iterations
        for value in (i.mean_reward, i.heldout_reward)
        if value is not None
    ]
    if min(rewards) >= 0 and max(rewards) <= 1:
        by_iteration.set_ylim(-0.03, 1.03)  # rewards within [0, 1]: the whole scale shows how far is left
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Reward of training run {run.run_id}")
    handles, labels = by_iteration.get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="outside lower center", ncol=min(4 if timed else 2, len(labels)), frameon=False
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def has_time_panel(run: TrainingRun, control: TrainingRun | None) -> bool:
    """Whether every run drawn recorded elapsed time (runs from before `elapsed_s` did not)."""
    return all(i.elapsed_s is not None for r in (run, control) if r is not None for i in r.iterations)


def _reward_lines(ax, run: TrainingRun, xs: list[float], is_control: bool) -> None:
    """Train reward, and held-out reward when the run evaluated one; None (every group
    dropped) leaves a gap rather than a fake point. The control's open squares sit under
    the run's dots, so where both start from the same weights both stay visible."""
    look = (
        dict(linestyle="--", marker="s", markersize=7, markerfacecolor="white", zorder=2)
        if is_control
        else dict(linestyle="-", marker="o", markersize=5, zorder=3)
    )
    label = f"{run.label} (control)" if is_control else run.label
    series = [("train", TRAIN_COLOR, [i.mean_reward for i in run.iterations])]
    if any(i.heldout_reward is not None for i in run.iterations):
        series.append(("held-out", HELDOUT_COLOR, [i.heldout_reward for i in run.iterations]))
    for name, color, values in series:
        ys = [float("nan") if v is None else v for v in values]
        ax.plot(xs, ys, color=color, label=f"{name} reward, {label}", **look)


def time_split(run: TrainingRun, path: Path) -> Path | None:
    """Where each iteration's wall time went. Recovery time is summed over trajectories that
    run side by side, so it is not a slice of the bar: it stands beside it as a stem."""
    if not run.iterations:
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator  # import cost: matplotlib, ~1 s

    span = run.iterations[-1].iteration - run.iterations[0].iteration + 1
    width = min(14.0, max(9.0, 0.6 * span + 5))
    inches_per_iteration = (width - 3.2) / span  # less the legend and the y axis
    labelled = inches_per_iteration >= 0.35  # room for "123s" over each bar
    fig, ax = plt.subplots(figsize=(width, 4.8), layout="constrained")
    handles = _phase_bars(ax, run, labelled)
    handles += _recovery_stems(ax, run, labelled)
    handles += _fault_names(ax, run, inches_per_iteration)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.set_title(f"Where each iteration's time went — training run {run.run_id}")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(handles=handles, loc="outside right upper", frameon=False, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _phase_bars(ax, run: TrainingRun, labelled: bool) -> list:
    """Rollout, train and publish stacked (they run one after the other), the total on top."""
    xs = [i.iteration - 0.1 for i in run.iterations]
    bottoms = [0.0] * len(xs)
    handles = []
    for phase, color in PHASE_COLORS.items():
        seconds = [getattr(i, f"{phase}_s") for i in run.iterations]
        handles.append(ax.bar(xs, seconds, bottom=bottoms, width=0.55, color=color, label=phase))
        bottoms = [b + s for b, s in zip(bottoms, seconds, strict=True)]
    for x, total in zip(xs, bottoms, strict=True):
        if labelled:
            ax.annotate(
                f"{total:.0f}s",
                (x, total),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    return handles


def _recovery_stems(ax, run: TrainingRun, labelled: bool) -> list:
    """Recovery time as a stem right of each bar that had any; an iteration without
    recoveries draws nothing, so the eye goes to the ones that had them."""
    hit = [i for i in run.iterations if i.recovery_s > 0]
    if not hit:
        return []
    xs = [i.iteration + 0.3 for i in hit]
    for x, record in zip(xs, hit, strict=True):
        ax.plot([x, x], [0, record.recovery_s], color=FAULT_COLOR, linewidth=2)
        if labelled:
            ax.annotate(
                f"{record.recovery_s:.0f}s",
                (x, record.recovery_s),
                xytext=(0, 5),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
                color=FAULT_COLOR,
                bbox=dict(facecolor="white", alpha=0.8, edgecolor="none", pad=0.5),
            )  # legible over a bar
    return ax.plot(
        xs,
        [i.recovery_s for i in hit],
        linestyle="none",
        marker="D",
        color=FAULT_COLOR,
        markersize=6,
        label="recovery, summed\nover trajectories",
    )


def _fault_names(ax, run: TrainingRun, inches_per_iteration: float) -> list:
    """The kinds of fault injected, one per line at the top of their iteration. Where two
    faulted iterations are too close for the names side by side, the names turn upright.
    The y axis gets the headroom they need above the tallest bar."""
    names: dict[int, list[str]] = {}
    for fault in run.faults:
        if fault.injected and fault.at is not None:
            names.setdefault(fault.at, []).append(fault.kind)
    if not names:
        return []
    longest = (max(len(name) for kinds in names.values() for name in kinds) + 2) * INCHES_PER_CHAR
    faulted = sorted(names)
    upright = any(
        (b - a) * inches_per_iteration < longest for a, b in zip(faulted, faulted[1:], strict=False)
    )
    extent = longest if upright else max(len(kinds) for kinds in names.values()) * LINE_INCHES
    ax.set_ylim(0, ax.get_ylim()[1] / (1 - (extent + BAR_LABEL_INCHES) / AXES_INCHES))
    for iteration, kinds in names.items():
        text = "\n".join(
            kinds if upright else [f"▼ {kind}" for kind in kinds]
        )  # upright, ▼ would point sideways
        ax.annotate(
            text,
            (iteration, 1),
            xycoords=("data", "axes fraction"),
            xytext=(0, -4),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=8,
            color=FAULT_COLOR,
            rotation=90 if upright else 0,
        )
    return ax.plot(
        [], [], linestyle="none", marker="v", color=FAULT_COLOR, label="fault injected\n(named above)"
    )
