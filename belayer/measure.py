"""What every benchmark and chaos soak records beside its figures: the spread of its
repetitions and the machine it ran on (cores, load), so a reader can tell a slow run from
a busy machine. Below both `bench` and `chaos`, which share it."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path


def spread(values, digits: int = 3) -> dict | None:
    """min / median / max of the values given (None ones dropped); None when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "min": round(min(values), digits),
        "median": round(statistics.median(values), digits),
        "max": round(max(values), digits),
    }


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


def goals(met: dict[str, bool]) -> dict:
    """A benchmark's goals for its report: `goals` (each goal as a sentence, and whether this
    run met it) and `goal_met` (all of them); `belayer bench` exits 1 naming each one missed."""
    return {"goals": met, "goal_met": all(met.values())}


def machine_load() -> dict:
    """Cores this process may use and the 1 / 5 / 15-minute load averages now."""
    return {"cores": len(os.sched_getaffinity(0)), "load_avg": [round(x, 2) for x in os.getloadavg()]}


def machine_description() -> dict:
    """What a reader needs to compare figures with their own machine: the CPU model, the
    cores this process may use, memory, kernel and OS, and the Belayer commit measured."""
    return {
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(int((_proc_field("/proc/meminfo", "MemTotal") or "0 kB").split()[0]) / 2**20, 1),
        "kernel": platform.release(),
        "os": _os_name(),
        "commit": _commit(),
    }


def _proc_field(path: str, name: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def _os_name() -> str:
    try:
        return platform.freedesktop_os_release().get("PRETTY_NAME", platform.system())
    except OSError:
        return platform.system()


def _commit() -> str:
    """The checkout's commit, with `+changes` when the work tree differs from it."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+changes" if dirty else "")
