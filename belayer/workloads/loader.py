"""Read and validate a workload file; every problem names the task, the field and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import TypeAdapter, ValidationError

from belayer.errors import BelayerError
from belayer.model.build import ModelSize
from belayer.workloads.drivers import HarborDriver
from belayer.workloads.harbor import is_harbor_path
from belayer.workloads.models import HarborSource, Task, Workload
from belayer.workloads.registry import DRIVERS, KINDS, UnknownTaskKind, driver_for_kind, task_kind


class WorkloadError(BelayerError):
    """The workload file is missing or invalid; nothing was started."""


_task_adapter: TypeAdapter[Task] = TypeAdapter(Task)
# The settings a workload may name that it was tuned with: (a number of this type, at
# least this, at most this, what it is, an example); `belayer train`'s flags override them.
TUNED_KEYS = {
    "lr": (float, 0, None, "a learning rate", "0.0001"),
    "group_size": (int, 2, 256, "a group size", "8"),
    "kl_coef": (float, 0, None, "a KL penalty's weight", "0.1"),
}
TOP_LEVEL_KEYS = {"tasks", "model", "heldout", "harbor", *TUNED_KEYS}
MODELS = get_args(ModelSize)


def load_workload(path: Path) -> Workload:
    """Parse `path` (.yaml/.yml or .jsonl) into a `Workload`, or raise `WorkloadError`."""
    raw_tasks, options = _read_document(path)
    if not raw_tasks and not options.get("harbor"):
        raise WorkloadError(
            f"{path}: the workload has no tasks; add at least one under `tasks:` (or Harbor paths under `harbor:`)"
        )
    tasks = [_validate_task(path, index, raw) for index, raw in enumerate(raw_tasks)]
    _refuse_duplicate_ids(path, tasks)
    return Workload(tasks=tasks, **_validate_options(path, options))


def _validate_options(path: Path, options: dict) -> dict:
    """The training keys beside `tasks:`: the model the tasks were made for, the held-out
    file, the settings they were tuned with."""
    model = options.get("model")
    if model is not None and model not in MODELS:
        raise WorkloadError(
            f"{path}: `model: {model}` is not a project-built model; use one of {', '.join(MODELS)}"
        )
    heldout = options.get("heldout")
    if heldout is not None:
        heldout = path.parent / str(heldout)
        if not heldout.is_file() and not is_harbor_path(heldout):
            raise WorkloadError(
                f"{path}: `heldout: {options['heldout']}` names no workload file or Harbor dataset (looked for {heldout})"
            )
    harbor = options.get("harbor") or []
    if not isinstance(harbor, list):
        raise WorkloadError(f"{path}: {HARBOR_ENTRIES}")
    harbor_sources = [_harbor_source(path, entry) for entry in harbor]
    tuned = {key: _tuned_value(path, key, options.get(key)) for key in TUNED_KEYS}
    return {"model": model, "heldout": heldout, "harbor": harbor_sources, **tuned}


def _tuned_value(path: Path, key: str, value):
    kind, least, most, what, example = TUNED_KEYS[key]
    numeric = (int,) if kind is int else (int, float)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numeric) or value < least or (most and value > most):
        whole = "a whole number" if kind is int else "a number"
        bounds = f"from {least} to {most}" if most else f">= {least}"
        raise WorkloadError(f"{path}: `{key}: {value}` is not {what}; give {whole} {bounds} (say {example})")
    return value


HARBOR_ENTRIES = (
    "`harbor:` must be a list of Harbor task directories or datasets, each a path or "
    "`{path: PATH, freeze_agent: true}`"
)


def _harbor_source(path: Path, entry: Any) -> HarborSource:
    """One `harbor:` entry: a path (relative to the workload file), or a path with options."""
    fields = {"path": entry} if isinstance(entry, str) else entry
    if not isinstance(fields, dict) or not isinstance(fields.get("path"), str):
        raise WorkloadError(f"{path}: {HARBOR_ENTRIES}; got {entry!r}")
    try:
        source = HarborSource.model_validate({**fields, "path": path.parent / fields["path"]})
    except ValidationError as err:
        problems = "; ".join(f"field {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise WorkloadError(f"{path}: `harbor: {entry}`: {problems}; {HARBOR_ENTRIES}") from None
    if not is_harbor_path(source.path):
        raise WorkloadError(
            f"{path}: `harbor: {fields['path']}` is no Harbor task directory or dataset "
            f"(looked for task.toml in {source.path})"
        )
    return source


def _read_document(path: Path) -> tuple[list[Any], dict]:
    if not path.is_file():
        raise WorkloadError(f"workload file {path} does not exist; give the path of a .yaml or .jsonl file")
    try:
        text = path.read_text(encoding="utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise WorkloadError(
            f"{path}: not UTF-8 text (byte {exc.start}): save the workload as UTF-8"
        ) from None
    if path.suffix == ".jsonl":
        return [
            _parse_json_line(path, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()
        ], {}
    if path.suffix not in (".yaml", ".yml"):
        raise WorkloadError(f"{path}: unknown workload format {path.suffix!r}; use .yaml, .yml or .jsonl")
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise WorkloadError(f"{path}: nested too deeply to be a workload; tasks are a flat list") from None
    if document is None:
        return [], {}
    if (
        not isinstance(document, dict)
        or not ({"tasks", "harbor"} & set(document))
        or set(document) - TOP_LEVEL_KEYS
    ):
        raise WorkloadError(
            f"{path}: the top level must be a mapping with `tasks:` (a list) and optionally "
            "`model:`, `heldout:`, `harbor:` and the settings it was tuned with (`lr:`, `group_size:`, `kl_coef:`)"
        )
    if not isinstance(document.get("tasks", []), list):
        raise WorkloadError(f"{path}: `tasks:` must be a list of tasks")
    return document.get("tasks") or [], {k: v for k, v in document.items() if k != "tasks"}


def _parse_json_line(path: Path, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except RecursionError:
        raise WorkloadError(f"{path}:{number}: nested too deeply to be a task") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(
            f"{path}:{number}: not valid JSON ({exc.msg}); one task object per line"
        ) from None


def _validate_task(path: Path, index: int, raw: Any) -> Task:
    """Validate `raw` into the model of its kind's driver (the registry's `Task` union)."""
    task_id = raw.get("id", f"#{index + 1}") if isinstance(raw, dict) else f"#{index + 1}"
    _refuse_unknown_kind(path, task_id, raw)
    try:
        return _task_adapter.validate_python(raw)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            location = [str(p) for p in error["loc"] if p not in KINDS]
            field = ".".join(location) or "(task)"
            problems.append(f"  field {field}: {error['msg']}{_fix_for(error)}")
        raise WorkloadError(f"{path}: task {task_id!r} is invalid:\n" + "\n".join(problems)) from None


def _refuse_unknown_kind(path: Path, task_id: str, raw: Any) -> None:
    """A kind no driver is registered for, named as such (not as a failed union match)."""
    if not isinstance(raw, dict):
        return
    if task_kind(raw) == HarborDriver.kind:
        raise WorkloadError(
            f"{path}: task {task_id!r} is invalid:\n  field kind: Harbor tasks are read from their task "
            "directories, not written here: list the directories or datasets under `harbor:`"
        )
    try:
        driver_for_kind(task_kind(raw))
    except UnknownTaskKind as exc:
        raise WorkloadError(f"{path}: task {task_id!r} is invalid:\n  field kind: {exc}") from None


def _fields_by_kind() -> str:
    """Each registered kind's fields, for the message about a field no kind has."""
    return "; ".join(
        f"{driver.kind} tasks take {', '.join(f for f in driver.model.model_fields if f != 'kind')}"
        for driver in DRIVERS
    )


def _fix_for(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return f" (unknown field: remove it; {_fields_by_kind()})"
    if error["type"] == "missing":
        return " (add it)"
    if error["type"] == "string_pattern_mismatch":
        return " (use letters, digits, '.', '_' or '-', at most 64 characters)"
    return ""


def _refuse_duplicate_ids(path: Path, tasks: list[Task]) -> None:
    seen: set[str] = set()
    for task in tasks:
        if task.id in seen:
            raise WorkloadError(f"{path}: task id {task.id!r} appears twice; task ids must be unique")
        seen.add(task.id)
