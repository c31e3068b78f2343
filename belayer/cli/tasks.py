"""`belayer tasks check PATH`: validate a Harbor task directory or dataset and build its images."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from belayer.cli.context import config_from, console, leave
from belayer.errors import BelayerError
from belayer.sandbox.backends import open_backend
from belayer.workloads.harbor import HarborTaskDir, HarborTaskError, is_task_dir, load_harbor, load_task


@dataclass
class TaskCheck:
    """What checking one task found: its problem, or its image and warnings."""

    task: str
    path: str
    steps: int = 0
    problem: str | None = None
    image: str | None = None
    image_id: str | None = None
    image_built_s: float | None = None  # None: found under its context hash, no build ran
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.problem is None


@click.group()
def tasks() -> None:
    """Harbor task directories and datasets (task.toml, instruction.md, environment/, tests/)."""


@tasks.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--no-build", is_flag=True, help="Validate the task files only; build no image.")
@click.option("--json", "as_json", is_flag=True, help='Print {"tasks": [...]} as JSON.')
@click.pass_context
def check(ctx: click.Context, path: Path, no_build: bool, as_json: bool) -> None:
    """Validate the Harbor task directory PATH, or every task of the dataset PATH, and
    build each task's image from its environment/Dockerfile (cached by the hash of the
    build context: an unchanged task is a lookup).

    Every problem is listed with its file and field; the exit status is 1 when any task
    has one. Builds run offline: a FROM image must be in Belayer's podman storage or
    mapped onto one by sandbox.base_images. Running the oracle and nop agents against
    the built images is not part of this check yet.
    """
    checks = [_validated(task_path) for task_path in _task_paths(path)]
    if not no_build:
        builder = open_backend(*_backend_args(ctx)).image_builder()
        for result, task in checks:
            if task is not None and result.ok:
                _build(builder, result, task, quiet=as_json)
    results = [result for result, _ in checks]
    if as_json:
        click.echo(json.dumps({"tasks": [_as_dict(r) for r in results]}, indent=2))
    else:
        _show(results)
    leave(0 if all(r.ok for r in results) else 1)


def _backend_args(ctx: click.Context) -> tuple:
    config = config_from(ctx.find_root())
    return config.sandbox, config.state_dir, config.cache_dir


def _task_paths(path: Path) -> list[Path]:
    """The task directories at `path`; a dataset's problems are found task by task."""
    if is_task_dir(path):
        return [path]
    children = sorted(c for c in path.iterdir() if c.is_dir() and not c.name.startswith("."))
    if not any(is_task_dir(child) for child in children):
        load_harbor(path)  # raises the message for a directory that is no task and no dataset
    return children


def _validated(path: Path) -> tuple[TaskCheck, HarborTaskDir | None]:
    result = TaskCheck(task=path.name, path=str(path))
    if not is_task_dir(path):
        result.problem = f"{path}: no task.toml: a dataset directory holds only task directories"
        return result, None
    try:
        task = load_task(path)
    except HarborTaskError as exc:
        result.problem = str(exc)
        return result, None
    result.steps = len(task.steps)
    result.warnings = list(task.warnings)
    if task.wants_network:
        result.warnings.append("asks for network (allow_internet defaults to true): runs offline here")
    return result, task


def _build(builder, result: TaskCheck, task: HarborTaskDir, quiet: bool) -> None:
    if task.environment_dir is None:  # a prebuilt docker_image
        reference = task.config.environment.docker_image
        result.image, result.image_id = reference, builder.image_id(reference)
        if result.image_id is None:
            result.problem = (f"{task.path}: [environment].docker_image {reference} is not in Belayer's podman "
                              "storage: load it there (podman load) or give the task an environment/Dockerfile")  # fmt: skip
        return
    started = time.monotonic()
    progress = None if quiet else (lambda line: console.print(f"  {line}", highlight=False, markup=False))
    try:
        image = builder.build(task.id, task.environment_dir, task.dockerfile,
                              timeout_s=task.config.environment.build_timeout_sec, progress=progress)  # fmt: skip
    except BelayerError as exc:
        result.problem = str(exc)
        return
    result.image, result.image_id = image.tag, image.image_id
    result.image_built_s = None if image.cached else round(time.monotonic() - started, 2)


def _as_dict(result: TaskCheck) -> dict:
    return {"task": result.task, "path": result.path, "ok": result.ok, "steps": result.steps,
            "problem": result.problem, "image": result.image, "image_id": result.image_id,
            "image_built_s": result.image_built_s, "warnings": result.warnings}  # fmt: skip


def _show(results: list[TaskCheck]) -> None:
    table = Table("task", "steps", "image", "result")
    for r in results:
        image = (
            "-"
            if r.image is None
            else r.image + (" (cached)" if r.image_built_s is None else f" (built in {r.image_built_s:g} s)")
        )
        outcome = "[green]ok[/]" if r.ok else "[red]problem[/]"
        table.add_row(r.task, str(r.steps), image, outcome)
    out = Console() if Console().is_terminal else Console(width=200)
    out.print(table)
    for r in results:
        for warning in r.warnings:
            console.print(f"[yellow]warning:[/] {escape(r.task)}: {escape(warning)}", highlight=False)
        if r.problem:
            console.print(f"[bold red]problem:[/] {escape(r.problem)}", highlight=False, soft_wrap=True)
    bad = sum(not r.ok for r in results)
    console.print(f"{len(results) - bad} of {len(results)} tasks ok", highlight=False)
