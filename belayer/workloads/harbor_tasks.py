"""Harbor task directories made into tasks the workflows run (`HarborTask`).

Reading and validating the directories is `harbor.py`'s; this is what happens before the
first trajectory starts: each task's image is built (or found by its context hash, or
taken from `docker_image`), its tests/ and solution/ are packed into tars put in the object
store (by content hash: a dataset run again uploads nothing), and the rest of task.toml
becomes fields of the task. The workflow payloads then carry the image's tag and the
tars' keys and hashes, never the files; the sandbox host unpacks them (the supervisor's
`install`) into the sandbox: each step's files (the oracle's solution, staged workdir/ files and setup.sh) as the step
begins, its tests when it is checked.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

from belayer.sandbox.backends import open_backend
from belayer.sandbox.models import ImageSemantics, StoredFiles
from belayer.storage.store import open_store, put_by_hash
from belayer.workloads.drivers import SOLUTION_DIR, shell_quote
from belayer.workloads.harbor import (
    HarborStep,
    HarborTaskDir,
    HarborTaskError,
    HealthcheckConfig,
    is_harbor_path,
    load_harbor,
)
from belayer.workloads.loader import WorkloadError, load_workload
from belayer.workloads.models import HarborSource, Workload
from belayer.workloads.tasks import HarborAgent, HarborStepSpec, HarborTask

FILES_PREFIX = "harbor/files"
STAGING_DIR = "/logs/agent/.belayer-staged"  # a step's files on their way into the WORKDIR
DEFAULT_WORKDIR = "/app"  # Harbor's tasks' WORKDIR by convention; the image's own wins
OFFLINE_NOTE = (
    "the task asks for network (allow_internet, Harbor's default): sandboxes have none, so it ran "
    "offline (--strict-network refuses such tasks instead)"
)
STORAGE_NOTE = (
    "[environment].storage_mb is not enforced: overlay size limits need XFS, which this host's "
    "podman storage is not on"
)


def load_harbor_tasks(path: Path, *, store, builder, agent: HarborAgent = "model", reward_key: str | None = None,
                      strict_network: bool = False, freeze_agent: bool = False, max_turns: int = 8,
                      progress: Callable[[str], None] | None = None) -> list[HarborTask]:  # fmt: skip
    """The Harbor task directory or dataset at `path` as tasks to run with `agent`: images
    built into `builder`'s podman storage, tests and solutions put in `store`. Raises
    `HarborTaskError` for a task that cannot run as asked, naming it and the fix."""
    tasks = []
    directories = load_harbor(path)
    for directory in directories:
        _refuse_unrunnable(directory, agent, strict_network)
        image = task_image(builder, directory, progress)
        task = _task(directory, image, store=store, builder=builder, agent=agent, reward_key=reward_key,
                     max_turns=max_turns)  # fmt: skip
        tasks.append(task.model_copy(update={"verify_with_processes": "frozen"}) if freeze_agent else task)
    return tasks


def _refuse_unrunnable(task: HarborTaskDir, agent: HarborAgent, strict_network: bool) -> None:
    if strict_network and task.wants_network:
        raise HarborTaskError(
            f"{task.path}: task {task.id} asks for network (allow_internet defaults to true) and "
            "--strict-network refuses it: set `allow_internet = false` in its [environment] if it runs offline"
        )
    unsolved = [step.name for step in task.steps if step.solution_dir is None]
    if agent == "oracle" and unsolved:
        where = "solution/" if not task.multi_step else f"steps/{unsolved[0]}/solution/"
        raise HarborTaskError(
            f"{task.path}: task {task.id} has no {where} for --agent oracle: add its solve.sh"
        )


def task_image(builder, task: HarborTaskDir, progress: Callable[[str], None] | None = None) -> str:
    """The tag of the task's image: `docker_image` when it is in Belayer's podman storage, else
    built from environment/Dockerfile (a lookup when its context is unchanged)."""
    if task.environment_dir is None:
        reference = task.config.environment.docker_image
        if builder.image_id(reference) is None:
            raise HarborTaskError(
                f"{task.path}: [environment].docker_image {reference} is not in Belayer's podman storage: "
                "load it there (podman load) or give the task an environment/Dockerfile"
            )
        return reference
    built = builder.build(task.id, task.environment_dir, task.dockerfile,
                          timeout_s=task.config.environment.build_timeout_sec, progress=progress)  # fmt: skip
    return built.tag


def _task(task: HarborTaskDir, image: str, *, store, builder, agent: HarborAgent, reward_key: str | None,
          max_turns: int) -> HarborTask:  # fmt: skip
    step = task.steps[0]
    environment = task.config.environment
    semantics = semantics_of(
        task, image, builder, agent_env=task.config.solution.env if agent == "oracle" else {}
    )
    uploads, setup = stage_files(store, step, agent, semantics.workdir)
    notes = list(task.warnings)
    if task.wants_network:
        notes.append(OFFLINE_NOTE)
    storage_declared = environment.storage_mb != 10240 or environment.storage is not None
    if storage_declared:
        notes.append(STORAGE_NOTE)
    return HarborTask(
        id=task.id,
        instruction=step.instruction,
        image=image,
        semantics=semantics.model_copy(update={"uploads": uploads}),
        setup=setup,
        agent=agent,
        max_turns=max_turns,
        agent_timeout_s=step.agent.timeout_sec or HarborTask.model_fields["agent_timeout_s"].default,
        tests=store_files(store, pack(list(step.tests_dirs))),
        verifier_timeout_s=step.verifier.timeout_sec,
        verifier_env=step.verifier.env,
        reward_key=reward_key,
        notes=notes,
        storage_mb=environment.storage_mb if storage_declared else None,
        metadata=task.config.metadata,
        step_name=step.name if task.multi_step else None,
        min_reward=step.min_reward,
        artifacts=artifact_paths(step, semantics.workdir),
        later_steps=[_later_step(store, later, agent, semantics.workdir) for later in task.steps[1:]],
        reward_strategy=task.config.multi_step_reward_strategy,
    )


def _later_step(store, step: HarborStep, agent: HarborAgent, workdir: str) -> HarborStepSpec:
    uploads, setup = stage_files(store, step, agent, workdir)
    return HarborStepSpec(
        name=step.name, instruction=step.instruction, tests=store_files(store, pack(list(step.tests_dirs))),
        uploads=uploads, setup_commands=setup,
        agent_timeout_s=step.agent.timeout_sec or HarborStepSpec.model_fields["agent_timeout_s"].default,
        verifier_timeout_s=step.verifier.timeout_sec, verifier_env=step.verifier.env, min_reward=step.min_reward,
        artifacts=artifact_paths(step, workdir),
    )  # fmt: skip


def artifact_paths(step: HarborStep, workdir: str) -> list[str]:
    """A step's `artifacts`, absolute (a relative one is in the WORKDIR)."""
    return [path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}" for path in step.artifacts]


def stage_files(
    store, step: HarborStep, agent: HarborAgent, workdir: str
) -> tuple[dict[str, StoredFiles], list[str]]:
    """What a step puts in the sandbox before its agent begins, as Harbor does: the oracle's
    solution at /solution; the step's `workdir/` files copied into the WORKDIR and its
    `setup.sh` run, both staged under /logs/agent (the agent's) and run as the agent: PID 1
    installs whole directories, never into the agent's tree; its healthcheck passed. Uploads
    and setup commands, in order."""
    uploads, setup = {}, []
    if agent == "oracle" and step.solution_dir is not None:
        uploads[SOLUTION_DIR] = store_files(store, pack([step.solution_dir]))
    if step.workdir_upload is not None:
        staged = f"{STAGING_DIR}/{step.name}-workdir"
        uploads[staged] = store_files(store, pack([step.workdir_upload]))
        setup.append(f"cp -a {staged}/. {shell_quote(workdir)}/")
    if step.setup_script is not None:
        staged = f"{STAGING_DIR}/{step.name}-setup"
        uploads[staged] = store_files(store, pack_files({"setup.sh": step.setup_script}))
        setup.append(f"cd {shell_quote(workdir)} && bash {staged}/setup.sh")
    if step.healthcheck is not None:
        setup.append(healthcheck_command(step.healthcheck))
    return uploads, setup


def semantics_of(task: HarborTaskDir, image: str, builder, *, agent_env: dict[str, str]) -> ImageSemantics:
    """How the task's image runs: its first step's agent and verifier users, its WORKDIR
    (task.toml's, else the image's, else Harbor's /app), its [environment] env and limits."""
    environment, step = task.config.environment, task.steps[0]
    return ImageSemantics(
        workdir=environment.workdir or _image_workdir(builder, image) or DEFAULT_WORKDIR,
        agent_user=_user(step.agent.user),
        verifier_user=_user(step.verifier.user) or "0",
        env={**environment.env, **agent_env},
        memory_mb=environment.memory_mb,
        cpus=environment.cpus,
    )


def _user(user: str | int | None) -> str | None:
    return None if user is None else str(user)


def _image_workdir(builder, image: str) -> str | None:
    """The image's WORKDIR, where a Harbor task's agent works unless task.toml names another."""
    found = builder.podman("image", "inspect", "--format", "{{.Config.WorkingDir}}", image)
    return found.stdout.strip() or None


def healthcheck_command(check: HealthcheckConfig) -> str:
    """Docker's HEALTHCHECK as a setup command: `command` retried until it passes (the sandbox
    is not handed to the agent before), each try bounded by its timeout."""
    quoted = shell_quote(check.command)
    return (
        f"sleep {check.start_period_sec:g}; for __try in $(seq {check.retries}); do "
        f"timeout {check.timeout_sec:g} bash -c {quoted} && exit 0; sleep {check.interval_sec:g}; done; "
        f"echo 'healthcheck failed {check.retries} times: '{quoted} >&2; exit 1"
    )


def pack(directories: list[Path]) -> bytes:
    """The files of `directories`, later ones over earlier same-named files, as a tar whose
    bytes depend only on their names, contents and executable bits (its hash is its key)."""
    files: dict[str, Path] = {}
    for directory in directories:
        for path in sorted(directory.rglob("*")):
            if path.is_symlink():
                raise HarborTaskError(f"{path}: a symbolic link; tests and solutions must be plain files")
            if path.is_file():
                files[path.relative_to(directory).as_posix()] = path
    return pack_files(files)


def pack_files(files: dict[str, Path]) -> bytes:
    """`files` (name in the tar -> file) as `pack` makes a tar."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            data = files[name].read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if files[name].stat().st_mode & 0o111 else 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def store_files(store, data: bytes) -> StoredFiles:
    """`data` in the store under its own hash (uploaded once, whoever asks again)."""
    stored = put_by_hash(store, f"{FILES_PREFIX}/", data, ".tar")
    return StoredFiles(key=stored.key, sha256=stored.sha256)


def runnable_workload(config, path: Path, *, agent: HarborAgent = "model", reward_key: str | None = None,
                      strict_network: bool = False, freeze_agent: bool = False,
                      progress: Callable[[str], None] | None = None):  # fmt: skip
    """The workload `belayer run PATH` and `belayer train PATH` start: a Harbor task directory
    or dataset made ready to run (images built, files stored), or a workload file's tasks with
    the Harbor paths it lists (`harbor:`) made ready beside them. Its `heldout` is left a path."""
    workload = Workload(harbor=[HarborSource(path=path)]) if is_harbor_path(path) else load_workload(path)
    if not workload.harbor:
        if agent != "model" or reward_key is not None:
            raise WorkloadError(f"{path}: --agent {agent} and --reward-key apply to Harbor tasks only")
        return workload
    builder = open_backend(config.sandbox, config.state_dir, config.cache_dir).image_builder()
    store = open_store(config.storage)
    harbor = [task for each in workload.harbor
              for task in load_harbor_tasks(each.path, store=store, builder=builder, agent=agent,
                                            reward_key=reward_key, strict_network=strict_network,
                                            freeze_agent=freeze_agent or each.freeze_agent,
                                            progress=progress)]  # fmt: skip
    tasks = [*workload.tasks, *harbor]
    ids = [task.id for task in tasks]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise WorkloadError(
            f"{path}: task ids repeat across its tasks and Harbor paths: {', '.join(repeated)}"
        )
    return workload.model_copy(update={"tasks": tasks, "harbor": []})
