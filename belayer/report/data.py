"""Read what `belayer run --json` or `belayer bench chaos --json` wrote into one shape:
trajectories (id, task, status, verdict, recoveries) and faults (kind, target, injection
time, recovery time). Nothing here draws or talks to a server."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from belayer.errors import BelayerError


class ReportError(BelayerError):
    """The report's input is missing or not a run / soak JSON."""


class Trajectory(BaseModel):
    id: str
    task: str
    status: str
    verdict: str = ""
    turns: int = 0
    recoveries: list[dict] = []
    step_times: list[tuple[int, float]] = []


class Fault(BaseModel):
    kind: str
    target: str
    at_step: int | None = None
    injected_at: float | None = None
    recovery_s: float | None = None
    recovered_by: str | None = None
    injected: bool = True


class RunData(BaseModel):
    source: str
    kind: str  # "soak" or "run"
    summary: dict = {}
    trajectories: list[Trajectory] = []
    faults: list[Fault] = []


def load_run(path: Path) -> RunData:
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path} does not exist; give the JSON of `belayer run --json` or "
                          "`belayer bench chaos --json`") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"{path} is not JSON ({exc}); give the output of `belayer run --json` or "
                          "`belayer bench chaos --json`") from None
    if isinstance(document, dict) and isinstance(document.get("details"), dict):
        return _from_soak(path, document)
    if isinstance(document, dict) and isinstance(document.get("trajectories"), list):
        return _from_run(path, document)
    raise ReportError(f"{path} is neither a `belayer run --json` result (no \"trajectories\" list) nor a "
                      "`belayer bench chaos --json` result (no \"details\")")


def _from_soak(path: Path, doc: dict) -> RunData:
    details = doc["details"]
    runs = [*details.get("references", {}).values(), *details.get("runs", [])]
    trajectories = [Trajectory(id=r["id"], task=r["task"], status=r["status"], verdict=r.get("verdict", ""),
                               turns=r.get("turns", 0), recoveries=r.get("recoveries", []),
                               step_times=[tuple(x) for x in r.get("step_times", [])]) for r in runs]
    faults = [Fault(kind=f["kind"], target=f["target"], at_step=f.get("at"), injected_at=f.get("injected_at"),
                    recovery_s=f.get("recovery_s"), recovered_by=f.get("recovered_by"),
                    injected=f.get("injected", True)) for f in details.get("faults", [])]
    summary = {k: v for k, v in doc.items() if k != "details"}
    return RunData(source=str(path), kind="soak", summary=summary, trajectories=trajectories, faults=faults)


def _from_run(path: Path, doc: dict) -> RunData:
    trajectories = [Trajectory(id=t["id"], task=t["task"], status=t["status"], turns=t.get("turns", 0),
                               recoveries=t.get("recoveries", [])) for t in doc["trajectories"]]
    faults = []
    for f in doc.get("faults", []):
        target = f.get("target") or ""
        # `belayer run` names the process or container it hit; the trajectory is what was watched
        trajectory = f.get("trajectory") or next((t.id for t in trajectories if t.id in target), target)
        faults.append(Fault(kind=f["kind"], target=trajectory, at_step=f.get("at"),
                            injected_at=f.get("injected_at"), recovery_s=f.get("recovery_s"),
                            recovered_by=f.get("recovered_by"), injected=f.get("at") is not None))
    summary = {"trajectories": len(trajectories), "wall_s": doc.get("wall_s"),
               "statuses": {s: sum(t.status == s for t in trajectories) for s in {t.status for t in trajectories}}}
    return RunData(source=str(path), kind="run", summary=summary, trajectories=trajectories, faults=faults)


def load_bench(path: Path) -> dict:
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"benchmark file {path}: not readable JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ReportError(f"benchmark file {path}: expected one JSON object (a `belayer bench ... --json` result)")
    return document
