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
from belayer.sandbox.host import make_host
from belayer.storage.errors import StorageError
from belayer.workloads.harbor import HarborTaskDir, HarborTaskError, is_task_dir, load_harbor, load_task
from belayer.workloads.harbor_check import check_agent


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
    prebuilt: bool = False  # [environment].docker_image: nothing to build
    metadata: dict = field(default_factory=dict)  # task.toml's [metadata], as written
    oracle: float | None = None  # what each agent scored (None: not run)
    nop: float | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


@click.group()
def tasks() -> None:
    """Harbor task directories and datasets (task.toml, instruction.md, environment/, tests/)."""


@tasks.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--no-build", is_flag=True, help="Validate the task files only; build no image, run nothing.")
@click.option("--no-run", is_flag=True, help="Build the images but run neither the oracle nor the nop agent.")
@click.option("--json", "as_json", is_flag=True, help='Print {"tasks": [...]} as JSON.')
@click.pass_context
def check(ctx: click.Context, path: Path, no_build: bool, no_run: bool, as_json: bool) -> None:
    """Validate the Harbor task directory PATH, or every task of the dataset PATH, build
    each task's image from its environment/Dockerfile (cached by the hash of the build
    context: an unchanged task is a lookup), then run its oracle (solution/solve.sh) and
    nop (nothing) agents in real sandboxes: a sound task scores 1 and 0.

    Every problem is listed with its file and field; the exit status is 1 when any task
    has one. Builds run offline: a FROM image must be in Belayer's podman storage or
    mapped onto one by sandbox.base_images. Running the agents needs the object store
    (`belayer up`); no Temporal, no engine.
    """
    checks = [_validated(task_path) for task_path in _task_paths(path)]
    if not no_build:
        config = config_from(ctx.find_root())
        builder = open_backend(config.sandbox, config.state_dir, config.cache_dir).image_builder()
        for result, task in checks:
            if task is not None and result.ok:
                _build(builder, result, task, quiet=as_json)
        if not no_run:
            _run_agents(
                make_host(config), builder, [(r, t) for r, t in checks if t is not None and r.ok], as_json
            )
    results = [result for result, _ in checks]
    if as_json:
        click.echo(json.dumps({"tasks": [_as_dict(r) for r in results]}, indent=2))
    else:
        _show(results)
    leave(0 if all(r.ok for r in results) else 1)


def _run_agents(host, builder, checks: list[tuple[TaskCheck, HarborTaskDir]], quiet: bool) -> None:
    """The oracle then the nop agent on each task; a task they do not score 1 and 0 has a problem."""
    for result, task in checks:
        for agent in ("oracle", "nop"):
            if agent == "oracle" and any(step.solution_dir is None for step in task.steps):
                result.warnings.append("no solution/: the oracle was not run")
                continue
            if not quiet:
                console.print(f"  {escape(task.id)}: running the {agent} agent", highlight=False)
            try:
                scored = check_agent(host, task, result.image, agent, builder)
            except StorageError as exc:
                result.problem = f"the {agent} agent could not run: {exc} (it needs the object store: `belayer up`, or --no-run)"
                break
            except BelayerError as exc:
                result.problem = f"the {agent} agent could not run: {exc}"
                break
            setattr(result, agent, scored.reward)
            expected = 1.0 if agent == "oracle" else 0.0
            if scored.reward != expected and result.problem is None:
                why = f" ({scored.problem})" if scored.problem else ""
                result.problem = (
                    f"the {agent} agent scored {scored.reward:g}, a sound task scores {expected:g}{why}"
                )


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
    result.metadata = task.config.metadata
    if task.wants_network:
        result.warnings.append("asks for network (allow_internet defaults to true): runs offline here")
    return result, task


def _build(builder, result: TaskCheck, task: HarborTaskDir, quiet: bool) -> None:
    if task.environment_dir is None:  # a prebuilt docker_image
        reference = task.config.environment.docker_image
        result.image, result.image_id, result.prebuilt = reference, builder.image_id(reference), True
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
            "image_built_s": result.image_built_s, "oracle": result.oracle, "nop": result.nop,
            "metadata": result.metadata, "warnings": result.warnings}  # fmt: skip


def _show(results: list[TaskCheck]) -> None:
    table = Table("task", "steps", "image", "oracle", "nop", "result")
    for r in results:
        image = (
            "-"
            if r.image is None
            else r.image
            + (
                " (prebuilt)"
                if r.prebuilt
                else " (cached)"
                if r.image_built_s is None
                else f" (built in {r.image_built_s:g} s)"
            )  # fmt: skip
        )
        outcome = "[green]ok[/]" if r.ok else "[red]problem[/]"
        scores = ["-" if score is None else f"{score:g}" for score in (r.oracle, r.nop)]
        table.add_row(r.task, str(r.steps), image, *scores, outcome)
    out = Console() if Console().is_terminal else Console(width=200)
    out.print(table)
    for r in results:
        if r.metadata:
            shown = ", ".join(f"{key}={value}" for key, value in r.metadata.items())
            console.print(f"[dim]{escape(r.task)}: {escape(shown)}[/]", highlight=False)
        for warning in r.warnings:
            console.print(f"[yellow]warning:[/] {escape(r.task)}: {escape(warning)}", highlight=False)
        if r.problem:
            console.print(f"[bold red]problem:[/] {escape(r.problem)}", highlight=False, soft_wrap=True)
    bad = sum(not r.ok for r in results)
    console.print(f"{len(results) - bad} of {len(results)} tasks ok", highlight=False)
