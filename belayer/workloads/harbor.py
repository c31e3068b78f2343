"""Harbor task directories, read and validated: the task format of Terminal-Bench 2 and the
datasets adapted to it (SWE-style repositories, data tasks, servers).

A task is a directory:

    task.toml              configuration ([task], [metadata], [agent], [verifier],
                           [environment], [solution], optionally [[steps]])
    instruction.md         what the agent is asked to do
    environment/Dockerfile the image the task runs in (or [environment].docker_image)
    tests/test.sh          the verifier; writes /logs/verifier/reward.txt or reward.json
    solution/solve.sh      optional: the reference solution the oracle agent runs

A multi-step task replaces instruction.md, tests/ and solution/ by `steps/<name>/`, one per
`[[steps]]` table, in order; a top-level tests/ is shared by every step (a step's own files
override same-named ones). A dataset is a directory of task directories; a task's id is
its directory's name.

The `harbor` package itself needs Python >= 3.12, and Belayer runs on 3.11, so the format
is read here from its documented schema, not through Harbor's own models. Reading is
strict, as Belayer's own workloads are: an unknown or malformed field is refused with the
file, the field and what was expected, because a silently ignored setting (a verifier
timeout, an environment variable the tests need) would turn into wrong rewards later.
Nothing here builds, uploads or starts anything.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from belayer.errors import BelayerError
from belayer.workloads.tasks import TASK_ID_PATTERN

TASK_FILE = "task.toml"
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


class HarborTaskError(BelayerError):
    """A Harbor task directory or dataset is missing a file or has an invalid field; nothing was started."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Author(_Strict):
    name: str
    email: str | None = None


class PackageInfo(_Strict):
    """`[task]`: the task's name in Harbor's registry (`org/name`), shown, never used as its id."""

    name: str
    description: str = ""
    authors: list[Author] = Field(default_factory=list)
    keywords: list[str] = Field(default_factory=list)


NetworkMode = Literal["public", "no-network", "allowlist"]


class _NetworkPolicy(_Strict):
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] = Field(default_factory=list)

    def wants_network(self) -> bool | None:
        """True when this section asks for any network, False when it asks for none, None when silent."""
        if self.network_mode is None:
            return True if self.allowed_hosts else None
        return self.network_mode != "no-network"


class VerifierConfig(_NetworkPolicy):
    timeout_sec: float = Field(600.0, gt=0, description="Seconds test.sh may run.")
    env: dict[str, str] = Field(default_factory=dict, description="The verifier's environment variables.")
    user: str | int | None = Field(None, description="User the verifier runs as (default: the image's USER).")


class AgentConfig(_NetworkPolicy):
    timeout_sec: float | None = Field(None, gt=0, description="Seconds the agent may work.")
    user: str | int | None = Field(
        None, description="User the agent's actions run as (default: the image's USER)."
    )


class SolutionConfig(_Strict):
    env: dict[str, str] = Field(default_factory=dict, description="The oracle's environment variables.")


class HealthcheckConfig(_Strict):
    """Docker HEALTHCHECK semantics: `command` must pass before the agent starts."""

    command: str = Field(min_length=1)
    interval_sec: float = Field(5.0, gt=0)
    timeout_sec: float = Field(30.0, gt=0)
    start_period_sec: float = Field(0.0, ge=0)
    start_interval_sec: float = Field(5.0, gt=0)
    retries: int = Field(3, ge=1)


class EnvironmentConfig(_NetworkPolicy):
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = Field(
        None, min_length=1, description="A prebuilt image instead of the Dockerfile."
    )
    os: Literal["linux"] = "linux"
    cpus: float = Field(1, gt=0)
    memory_mb: int = Field(2048, ge=16)
    storage_mb: int = Field(10240, ge=1)
    gpus: int = Field(0, ge=0, le=0, description="Sandboxes have no accelerators: 0.")
    gpu_types: list[str] | None = None
    allow_internet: bool = True
    mcp_servers: list[dict[str, Any]] = Field(default_factory=list, max_length=0)
    env: dict[str, str] = Field(
        default_factory=dict, description="Resolved from the host: ${VAR}, ${VAR:-default}."
    )
    skills_dir: str | None = None
    healthcheck: HealthcheckConfig | None = None
    workdir: str | None = Field(
        None, description="The agent's working directory (default: the image's WORKDIR)."
    )
    # Harbor's deprecated spellings of memory_mb and storage_mb ("2G", "512M").
    memory: str | None = None
    storage: str | None = None

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("an absolute path inside the container (e.g. /app)")
        return value

    def wants_network(self) -> bool | None:
        explicit = super().wants_network()
        return self.allow_internet if explicit is None else explicit


class StepConfig(_Strict):
    """One `[[steps]]` table: its files live in `steps/<name>/`."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    agent: AgentConfig = Field(default_factory=AgentConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    min_reward: float | None = Field(
        None, description="Stop the task after this step when its reward is below."
    )
    healthcheck: HealthcheckConfig | None = None
    artifacts: list[str] = Field(default_factory=list, description="Paths collected after the step.")


class TaskConfig(_Strict):
    """task.toml, as Harbor's schema 1.x defines it (`version` is 1.0's name of `schema_version`)."""

    schema_version: str = "1.1"
    version: str | None = None
    source: str | None = None
    task: PackageInfo | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    solution: SolutionConfig = Field(default_factory=SolutionConfig)
    steps: list[StepConfig] = Field(default_factory=list)
    multi_step_reward_strategy: Literal["mean", "final"] = "mean"


@dataclass(frozen=True)
class HarborStep:
    """What one step of a task asks and how it is judged; a single-step task has one."""

    name: str
    instruction: str
    tests_dirs: tuple[Path, ...]  # copied to /tests in order: later files override earlier ones
    solution_dir: Path | None
    setup_script: Path | None
    workdir_upload: Path | None
    agent: AgentConfig
    verifier: VerifierConfig
    min_reward: float | None = None
    healthcheck: HealthcheckConfig | None = None
    artifacts: tuple[str, ...] = ()


@dataclass(frozen=True)
class HarborTaskDir:
    """One validated task directory: its configuration, steps and the files its image is built from."""

    id: str
    path: Path
    config: TaskConfig
    steps: tuple[HarborStep, ...]
    environment_dir: Path | None
    warnings: tuple[str, ...] = field(default=())

    @property
    def dockerfile(self) -> Path | None:
        return None if self.environment_dir is None else self.environment_dir / "Dockerfile"

    @property
    def multi_step(self) -> bool:
        return bool(self.config.steps)

    @property
    def wants_network(self) -> bool:
        """Whether any phase asks for network (Harbor's default does): sandboxes have none."""
        sections = (self.config.environment, self.config.agent, self.config.verifier)
        return any(section.wants_network() for section in sections)


def is_task_dir(path: Path) -> bool:
    return (path / TASK_FILE).is_file()


def is_harbor_path(path: Path) -> bool:
    """Whether `path` is a Harbor task directory or a directory holding some (a dataset)."""
    if not path.is_dir():
        return False
    return is_task_dir(path) or any(is_task_dir(child) for child in _subdirs(path))


def load_harbor(path: Path, env: dict[str, str] | None = None) -> list[HarborTaskDir]:
    """The tasks at `path`: one task directory, or a dataset of them (sorted by id)."""
    if not path.is_dir():
        raise HarborTaskError(f"{path}: not a directory; give a Harbor task directory or a dataset of them")
    if is_task_dir(path):
        return [load_task(path, env)]
    return load_dataset(path, env)


def load_dataset(path: Path, env: dict[str, str] | None = None) -> list[HarborTaskDir]:
    """Every task directory of a dataset; a subdirectory that is no task is refused by name."""
    children = _subdirs(path)
    not_tasks = [child.name for child in children if not is_task_dir(child)]
    if not_tasks:
        raise HarborTaskError(
            f"{path}: {', '.join(sorted(not_tasks))} has no {TASK_FILE}: a dataset directory holds only "
            "task directories (move other directories out, or give the task directory itself)"
        )
    if not children:
        raise HarborTaskError(f"{path}: no {TASK_FILE} here and no task directory under it")
    return [load_task(child, env) for child in sorted(children)]


def load_task(path: Path, env: dict[str, str] | None = None) -> HarborTaskDir:
    """Read and validate one task directory; `env` resolves `[environment].env` templates
    (default: this process's environment, as Harbor resolves them from the host)."""
    task_id = path.name
    if not re.match(TASK_ID_PATTERN, task_id):
        raise HarborTaskError(
            f"{path}: the directory name {task_id!r} is the task's id and must use letters, digits, "
            "'.', '_' or '-' (at most 64 characters, starting with a letter or digit): rename the directory"
        )
    config = _read_config(path / TASK_FILE)
    warnings = _normalize_sizes(path / TASK_FILE, config)
    config.environment.env = resolve_env(
        path / TASK_FILE, config.environment.env, os.environ if env is None else env
    )
    environment_dir = _environment_dir(path, config)
    steps = _multi_steps(path, config) if config.steps else (_single_step(path, config),)
    return HarborTaskDir(
        id=task_id, path=path, config=config, steps=steps, environment_dir=environment_dir, warnings=warnings
    )


def _subdirs(path: Path) -> list[Path]:
    return [child for child in path.iterdir() if child.is_dir() and not child.name.startswith(".")]


def _read_config(path: Path) -> TaskConfig:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise HarborTaskError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{path}: not valid TOML: {exc}") from None
    try:
        return TaskConfig.model_validate(raw)
    except ValidationError as exc:
        raise HarborTaskError(f"{path}: invalid:\n" + "\n".join(_problems(exc))) from None


_EXPECTED = {
    "extra_forbidden": "unknown field: remove it (Belayer reads Harbor's task.toml schema 1.x)",
    "missing": "required: add it",
}
_UNSUPPORTED = {
    "environment.gpus": "sandboxes have no accelerators: remove it or set 0",
    "environment.mcp_servers": "MCP servers are not supported: remove them",
    "environment.os": "only Linux containers run here",
}


def _problems(exc: ValidationError) -> list[str]:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        general = re.sub(r"\[\d+\]", "", where)
        steps_free = re.sub(r"^steps\.\d+\.", "steps.", general)
        expected = _UNSUPPORTED.get(steps_free) or _EXPECTED.get(error["type"]) or error["msg"]
        problems.append(f"  field {where}: {expected} (got {_shown(error.get('input'))})")
    return problems


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([GMK])B?\s*$", re.IGNORECASE)
_SIZE_MB = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}


def _normalize_sizes(path: Path, config: TaskConfig) -> tuple[str, ...]:
    """Harbor's deprecated `memory`/`storage` strings ("2G") into `memory_mb`/`storage_mb`."""
    environment, warnings = config.environment, []
    for old, new in (("memory", "memory_mb"), ("storage", "storage_mb")):
        value = getattr(environment, old)
        if value is None:
            continue
        match = _SIZE.match(value)
        if match is None:
            raise HarborTaskError(
                f"{path}: invalid:\n  field environment.{old}: a size like '2G' or '512M' (got {value!r}); "
                f"better, use {new} (an integer of MiB)"
            )
        setattr(environment, new, max(1, math.floor(float(match[1]) * _SIZE_MB[match[2].upper()])))
        setattr(environment, old, None)
        warnings.append(f"environment.{old} is deprecated: read as {new} = {getattr(environment, new)}")
    return tuple(warnings)


_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def resolve_env(path: Path, values: dict[str, str], host: Any) -> dict[str, str]:
    """`[environment].env` with `${VAR}` and `${VAR:-default}` taken from the host; a `${VAR}`
    the host lacks (and no default) is refused by name rather than passed on empty."""

    def substitute(name: str, match: re.Match) -> str:
        variable, default = match[1], match[2]
        if variable in host:
            return host[variable]
        if default is not None:
            return default
        raise HarborTaskError(
            f"{path}: environment.env.{name} needs ${{{variable}}}, which is not set here: set it, "
            f"or write ${{{variable}:-DEFAULT}}"
        )

    return {name: _TEMPLATE.sub(lambda m, n=name: substitute(n, m), value) for name, value in values.items()}


def _environment_dir(path: Path, config: TaskConfig) -> Path | None:
    """The build context; None for a task that names a prebuilt `docker_image` and has none."""
    environment = path / "environment"
    compose = [name for name in COMPOSE_FILES if (environment / name).is_file()]
    if compose:
        raise HarborTaskError(
            f"{path}: environment/{compose[0]}: compose-based task environments are not supported "
            "(one container per sandbox): give the task an environment/Dockerfile"
        )
    if (environment / "Dockerfile").is_file():
        return environment
    if config.environment.docker_image:
        return None
    raise HarborTaskError(
        f"{path}: no environment/Dockerfile and no [environment].docker_image: add one of them"
    )


def _text(path: Path, what: str) -> str:
    if not path.is_file():
        raise HarborTaskError(f"{path}: missing: every task needs {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise HarborTaskError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if not text.strip():
        raise HarborTaskError(f"{path}: empty: write {what}")
    return text


def _optional_dir(path: Path) -> Path | None:
    return path if path.is_dir() else None


def _optional_file(path: Path) -> Path | None:
    return path if path.is_file() else None


def _single_step(path: Path, config: TaskConfig) -> HarborStep:
    tests = path / "tests"
    if not (tests / "test.sh").is_file():
        raise HarborTaskError(f"{tests / 'test.sh'}: missing: every task needs a verifier, tests/test.sh")
    return HarborStep(
        name=path.name,
        instruction=_text(path / "instruction.md", "the agent's instruction, instruction.md"),
        tests_dirs=(tests,),
        solution_dir=_optional_dir(path / "solution"),
        setup_script=None,
        workdir_upload=None,
        agent=config.agent,
        verifier=config.verifier,
        healthcheck=config.environment.healthcheck,
    )


def _multi_steps(path: Path, config: TaskConfig) -> tuple[HarborStep, ...]:
    """Each `[[steps]]` table with its `steps/<name>/` files; the task's own [agent] and
    [verifier] settings apply where a step does not set its own."""
    names = [step.name for step in config.steps]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise HarborTaskError(
            f"{path / TASK_FILE}: field steps: step names repeat ({', '.join(repeated)}): make them unique"
        )
    shared_tests = _optional_dir(path / "tests")
    steps = []
    for step in config.steps:
        directory = path / "steps" / step.name
        if not directory.is_dir():
            raise HarborTaskError(
                f"{directory}: missing: task.toml's step {step.name!r} needs its directory steps/{step.name}/"
            )
        own_tests = _optional_dir(directory / "tests")
        tests_dirs = tuple(d for d in (shared_tests, own_tests) if d is not None)
        if not any((d / "test.sh").is_file() for d in tests_dirs):
            raise HarborTaskError(
                f"{directory}: no tests/test.sh for step {step.name!r}, here or in the task's tests/: add one"
            )
        steps.append(HarborStep(
            name=step.name,
            instruction=_text(directory / "instruction.md", f"step {step.name!r}'s instruction, instruction.md"),
            tests_dirs=tests_dirs,
            solution_dir=_optional_dir(directory / "solution"),
            setup_script=_optional_file(directory / "setup.sh"),
            workdir_upload=_optional_dir(directory / "workdir"),
            agent=_merged(config.agent, step.agent),
            verifier=_merged(config.verifier, step.verifier),
            min_reward=step.min_reward,
            healthcheck=step.healthcheck or config.environment.healthcheck,
            artifacts=tuple(step.artifacts),
        ))  # fmt: skip
    return tuple(steps)


def _merged(task_level: BaseModel, step_level: BaseModel) -> Any:
    """The step's settings over the task's: a field the step sets wins, `env` merges."""
    merged = task_level.model_copy(update=step_level.model_dump(exclude_unset=True))
    if hasattr(merged, "env"):
        merged.env = {**task_level.env, **step_level.env}
    return merged
