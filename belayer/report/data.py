"""Read what `belayer run --json` or `belayer bench chaos --json` wrote into one shape:
trajectories (id, task, status, verdict, recoveries) and faults (kind, target, injection
time, recovery time); and what `belayer train --json` wrote into another: the run's
settings, one record per iteration, the faults injected. Nothing here draws or talks to a
server."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ValidationError

from belayer.errors import BelayerError

EXPECTED_INPUTS = (
    'a `belayer run --json` result (a "trajectories" list), a `belayer bench chaos --json` result '
    '(a "details" object) or a `belayer train --json` result ("run_id", "status" and an '
    '"iterations" list)'
)


class ReportError(BelayerError):
    """The report's input is missing or not a run / soak / training JSON."""


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


class TrainingIteration(BaseModel):
    """One entry of a training run's `iterations`; the fields the report shows. Runs from
    before `recovery_s` and `elapsed_s` were recorded still load (no elapsed-time panel)."""

    iteration: int
    mean_reward: float | None
    heldout_reward: float | None = None
    groups_kept: int
    groups_dropped: int
    infra_retries: int
    weights_version: int
    weights_sha256: str
    rollout_s: float
    train_s: float
    publish_s: float
    recovery_s: float = 0.0
    elapsed_s: float | None = None
    engine_logprob_drift: float | None = None
    mean_actions_per_trajectory: float | None = None
    dropped: list[dict] = []
    # The trainer's numbers (None in a run from before they were reported):
    loss: float | None = None
    kl: float | None = None
    clip_fraction: float | None = None
    entropy: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    response_tokens: float | None = None
    rewards_by_family: dict[str, float] = {}


class TrainingFault(BaseModel):
    """A fault `belayer train --chaos` planned: `at` is the iteration it was aimed at;
    `recovered_by` says "not injected: why" when it never hit."""

    kind: str
    at: int | None = None
    target: str | None = None
    recovered_by: str | None = None
    recovery_s: float | None = None

    @property
    def injected(self) -> bool:
        return not (self.recovered_by or "").startswith("not injected")


class TrainingRun(BaseModel):
    source: str
    run_id: str
    status: str
    reason: str = ""
    settings: dict = {}
    iterations: list[TrainingIteration]
    final_weights_sha256: str | None = None
    faults: list[TrainingFault] = []

    @property
    def lr(self) -> float | None:
        return self.settings.get("lr")

    @property
    def label(self) -> str:
        """How figures and tables tell runs apart: by learning rate, the one setting a control changes."""
        return f"lr={self.lr:g}" if self.lr is not None else f"run {self.run_id}"


def load_input(path: Path) -> RunData | TrainingRun:
    """Whichever of the three results `path` holds."""
    document = _read_json(path)
    if is_training(document):
        return _from_training(path, document)
    return _run_or_soak(path, document)


def load_run(path: Path) -> RunData:
    """A run or soak result; a training result is an error here."""
    return _run_or_soak(path, _read_json(path))


def load_training(path: Path, role: str = "training result") -> TrainingRun:
    """A `belayer train --json` result; `role` names it in errors (e.g. the control)."""
    document = _read_json(path)
    if not is_training(document):
        raise ReportError(
            f'{role} {path} is not a `belayer train --json` result: expected "run_id", '
            '"status" and an "iterations" list'
        )
    return _from_training(path, document)


def is_training(document) -> bool:
    return (
        isinstance(document, dict) and "run_id" in document and isinstance(document.get("iterations"), list)
    )


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(
            f"{path} does not exist; give the JSON of `belayer run --json`, "
            "`belayer bench chaos --json` or `belayer train --json`"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(
            f"{path} is not JSON ({exc}); give the output of `belayer run --json`, "
            "`belayer bench chaos --json` or `belayer train --json`"
        ) from None


def _run_or_soak(path: Path, document) -> RunData:
    if isinstance(document, dict) and isinstance(document.get("details"), dict):
        return _from_soak(path, document)
    if isinstance(document, dict) and isinstance(document.get("trajectories"), list):
        return _from_run(path, document)
    keys = f" (its keys: {', '.join(sorted(document)) or 'none'})" if isinstance(document, dict) else ""
    raise ReportError(f"{path} is not a result the report reads{keys}; expected {EXPECTED_INPUTS}")


def _from_training(path: Path, doc: dict) -> TrainingRun:
    try:
        return TrainingRun(
            source=str(path),
            run_id=doc["run_id"],
            status=doc.get("status", "unknown"),
            reason=doc.get("reason", ""),
            settings=doc.get("settings") or {},
            iterations=doc["iterations"],
            final_weights_sha256=doc.get("final_weights_sha256"),
            faults=doc.get("faults") or [],
        )
    except ValidationError as exc:
        raise ReportError(
            f"{path} looks like a `belayer train --json` result but {_first_problem(exc, doc)}"
        ) from None


def _first_problem(exc: ValidationError, doc: dict) -> str:
    """The first invalid field, named the way the JSON names it (e.g. iterations[2].rollout_s)."""
    error = exc.errors()[0]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
    if error["type"] == "missing" and error["loc"][0] == "iterations":
        required = [name for name, field in TrainingIteration.model_fields.items() if field.is_required()]
        return f"{where} is missing (each iteration needs {', '.join(required)})"
    if error["type"] == "missing":
        return f"{where} is missing"
    return f"{where} is {_value_at(doc, error['loc'])!r}: {error['msg']}"


def _value_at(doc, loc):
    for part in loc:
        try:
            doc = doc[part]
        except (KeyError, IndexError, TypeError):
            return None
    return doc


def _from_soak(path: Path, doc: dict) -> RunData:
    details = doc["details"]
    runs = [*details.get("references", {}).values(), *details.get("runs", [])]
    trajectories = [
        Trajectory(
            id=r["id"],
            task=r["task"],
            status=r["status"],
            verdict=r.get("verdict", ""),
            turns=r.get("turns", 0),
            recoveries=r.get("recoveries", []),
            step_times=[tuple(x) for x in r.get("step_times", [])],
        )
        for r in runs
    ]
    faults = [
        Fault(
            kind=f["kind"],
            target=f["target"],
            at_step=f.get("at"),
            injected_at=f.get("injected_at"),
            recovery_s=f.get("recovery_s"),
            recovered_by=f.get("recovered_by"),
            injected=f.get("injected", True),
        )
        for f in details.get("faults", [])
    ]
    summary = {k: v for k, v in doc.items() if k != "details"}
    return RunData(source=str(path), kind="soak", summary=summary, trajectories=trajectories, faults=faults)


def _from_run(path: Path, doc: dict) -> RunData:
    trajectories = [
        Trajectory(
            id=t["id"],
            task=t["task"],
            status=t["status"],
            turns=t.get("turns", 0),
            recoveries=t.get("recoveries", []),
        )
        for t in doc["trajectories"]
    ]
    faults = []
    for f in doc.get("faults", []):
        target = f.get("target") or ""
        # `belayer run` names the process or container it hit; the trajectory is what was watched
        trajectory = f.get("trajectory") or next((t.id for t in trajectories if t.id in target), target)
        faults.append(
            Fault(
                kind=f["kind"],
                target=trajectory,
                at_step=f.get("at"),
                injected_at=f.get("injected_at"),
                recovery_s=f.get("recovery_s"),
                recovered_by=f.get("recovered_by"),
                injected=f.get("at") is not None,
            )
        )
    summary = {
        "trajectories": len(trajectories),
        "wall_s": doc.get("wall_s"),
        "statuses": {s: sum(t.status == s for t in trajectories) for s in {t.status for t in trajectories}},
    }
    return RunData(source=str(path), kind="run", summary=summary, trajectories=trajectories, faults=faults)


# Settings added after runs were recorded, with what a run recorded without them did: an
# older control ran GRPO, so "grpo" against a missing value is no difference.
_SETTINGS_ADDED_LATER = {"algorithm": "grpo"}


def control_warnings(run: TrainingRun, control: TrainingRun) -> list[str]:
    """Why `control` may not be a fair baseline for `run`. A control is the same run with
    the learning rate at 0; any other difference is named, never refused: the page still
    draws both, and the reader judges. Workloads compare by file name, since the two runs
    may have been started from different directories."""
    if not run.settings or not control.settings:
        return [
            "the run or the control has no settings (an older `belayer train --json`): "
            "they could not be checked to be the same workload"
        ]
    ran, controlled = _SETTINGS_ADDED_LATER | run.settings, _SETTINGS_ADDED_LATER | control.settings
    warnings = []
    if Path(str(run.settings.get("workload"))).name != Path(str(control.settings.get("workload"))).name:
        warnings.append(
            f"the control ran a different workload ({control.settings.get('workload')}) "
            f"than the run ({run.settings.get('workload')}): the curves do not compare like for like"
        )
    others = [
        key
        for key in sorted(ran.keys() | controlled.keys())
        if key not in ("workload", "lr", "iterations") and ran.get(key) != controlled.get(key)
    ]
    if others:
        warnings.append(
            "the control differs from the run in more than the learning rate: "
            + "; ".join(
                f"{key} {ran.get(key)} in the run, {controlled.get(key)} in the control" for key in others
            )
        )
    if run.lr == control.lr:
        warnings.append(f"the control has the run's own learning rate ({run.lr}); a control usually has lr 0")
    return warnings


def load_bench(path: Path) -> dict:
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"benchmark file {path}: not readable JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ReportError(
            f"benchmark file {path}: expected one JSON object (a `belayer bench ... --json` result)"
        )
    return document
