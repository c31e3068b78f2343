"""What every benchmark records beside its figures: the spread of its repetitions and the
machine it ran on (cores, load), so a reader can tell a slow run from a busy machine."""

from __future__ import annotations

import os
import statistics


def spread(values, digits: int = 3) -> dict | None:
    """min / median / max of the values given (None ones dropped); None when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": round(min(values), digits), "median": round(statistics.median(values), digits),
            "max": round(max(values), digits)}


def spread_cells(figures: dict | None) -> list[str]:
    """A spread's min, median and max as table cells (2 decimals); dashes where nothing
    was measured."""
    if figures is None:
        return ["-"] * 3
    return [f"{figures[k]:.2f}" for k in ("min", "median", "max")]


def rotated(modes, repetitions: int) -> list[tuple[int, str]]:
    """(repetition, mode) in run order, the modes' order rotated by one each repetition, so
    drift on a shared machine (other jobs, a warming cache) lands on every mode alike."""
    return [(rep, modes[(rep + i) % len(modes)]) for rep in range(repetitions) for i in range(len(modes))]


def machine_load() -> dict:
    """Cores this process may use and the 1 / 5 / 15-minute load averages now."""
    return {"cores": len(os.sched_getaffinity(0)), "load_avg": [round(x, 2) for x in os.getloadavg()]}
