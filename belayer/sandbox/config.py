"""Sandbox settings: limits and runtime of the agent's containers."""

from typing import Literal

from pydantic import Field, field_validator, model_validator

from belayer.sandbox import backends, runtime
from belayer.section import Section

# Names a task's Dockerfile may start FROM that the local Debian base stands in for by default:
# the same family of distribution, so `apt-get`, `bash` and coreutils behave as the task expects.
DEBIAN_LIKE_IMAGES = ("debian:bookworm", "debian:bookworm-slim", "debian:12", "debian:12-slim",
                      "ubuntu:22.04", "ubuntu:24.04", "ubuntu:latest")  # fmt: skip


class SandboxConfig(Section):
    """Per-sandbox limits, the host's task queue and where checkpoints go."""

    backend: str = Field(
        "podman",
        description="Container backend, by its name in belayer/sandbox/backends.py; podman (+ runc + "
        "CRIU), the default, is the one there today.",
    )
    image: str = Field(
        default_factory=runtime.base_image_name,
        description="Base image every sandbox starts from; default: the one infra/install/base-image.sh builds "
        "(localhost/belayer-base:v<BASE_IMAGE_VERSION of infra/versions.env>).",
    )
    base_images: dict[str, str] = Field(
        default_factory=lambda: dict.fromkeys(DEBIAN_LIKE_IMAGES, runtime.base_image_name()),
        description="What a task image's `FROM` stands for when that image is not in Belayer's podman storage "
        "(sandboxes build offline): name -> local image. Default: the common Debian and Ubuntu names -> the base "
        "image (Debian bookworm with python3.11, git, make). A FROM neither present nor mapped is refused by name.",
    )
    read_only_root: bool = Field(
        True,
        description="Mount the image's root file system read-only. Off only for a task whose own image "
        "writes outside the tmpfs mounts: the agent may then change any file of the image (Belayer's own "
        "programs run from the read-only toolchain, never from there), the changes travel in checkpoints, and "
        "nothing bounds what it writes to the host's disk through the container's overlay.",
    )
    toolchain_dir: str = Field(
        "",
        description="Host directory of Belayer's trusted toolchain, mounted read-only at /.belayer: the "
        "interpreter PID 1, the action helper and the workspace hash run from (belayer/sandbox/toolchain.py). "
        "Empty: the one infra/install/toolchain.sh built for this checkout, <cache>/toolchain/<content hash>, "
        "the same path on every sandbox host built alike (a restore re-creates the mount at the recorded path).",
    )
    memory_mb: int = Field(
        1024,
        ge=64,
        le=1 << 20,
        description="Memory limit per sandbox (MiB); the tmpfs mounts count against it.",
    )
    cpus: float = Field(1.0, gt=0, le=64, description="CPU limit per sandbox (cores).")
    pids_limit: int = Field(
        256, ge=16, le=1 << 22, description="Process limit per sandbox (stops fork bombs)."
    )
    workspace_mb: int = Field(
        256,
        ge=16,
        le=1 << 20,
        description="Size of the /workspace tmpfs (MiB); it travels inside checkpoints.",
    )
    home_mb: int = Field(
        64,
        ge=4,
        le=1 << 20,
        description="Size of the agent's home tmpfs /home/agent (MiB); travels in checkpoints.",
    )
    tmp_mb: int = Field(
        64, ge=4, le=1 << 20, description="Size of the /tmp tmpfs (MiB); travels in checkpoints."
    )
    run_mb: int = Field(
        8,
        ge=1,
        le=4096,
        description="Size of the /run tmpfs (MiB; pid files, sockets); travels in checkpoints.",
    )
    shm_mb: int = Field(
        64,
        ge=1,
        le=1 << 20,
        description="Size of /dev/shm (MiB; POSIX shared memory); travels in checkpoints.",
    )
    journal_mb: int = Field(
        64,
        ge=4,
        le=4096,
        description="Size of the supervisor's journal tmpfs (MiB); when full, old observations keep only hashes.",
    )
    action_timeout_s: float = Field(60.0, gt=0, le=86400, description="Default per-action timeout (seconds).")
    output_cap_bytes: int = Field(
        64 * 1024,
        ge=1024,
        le=128 * 1024,
        description="Captured stdout (and stderr) per action before truncation; bounded so an observation "
        "(invalid bytes escaped as 4 characters) stays well under Temporal's 2 MB payload limit.",
    )
    host_task_queue: str | None = Field(
        None, description="This host's task queue; default 'belayer-sandbox-<hostname>'."
    )
    channel_root: str = Field(
        "/run/belayer/sbx",
        description="Host directory holding each sandbox's supervisor socket directory; must be the same "
        "path on every sandbox host (restores re-create the bind-mount source at the recorded path).",
    )
    checkpoint_prefix: str = Field(
        "sandboxes/", description="Object-store key prefix of checkpoint archives and their metadata."
    )
    checkpoint_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness added to a checkpoint's work (podman, CRIU, compression, upload): "
        "it runs beside the next generation, and at a lower priority the engine keeps its speed when they share "
        "cores (belayer/sandbox/priority.py). 0 runs it at the worker's own priority; a drain's checkpoint, "
        "which nothing overlaps, always does.",
    )
    checkpoint_compression: Literal["zstd", "gzip", "none"] = Field(
        "zstd",
        description="Compression of checkpoint archives, run on every core after the dump "
        "(belayer/sandbox/compression.py); none stores them plain, the faster choice when the link "
        "to the object store beats ~300 MB/s.",
    )
    fork_concurrency: int = Field(
        4,
        ge=1,
        le=256,
        description="Forks of one checkpoint restored at once on a host (podman + CRIU each).",
    )
    start_timeout_s: float = Field(
        30.0, gt=0, le=600, description="How long create/restore wait for the supervisor to answer."
    )
    max_sandboxes: int = Field(
        64,
        ge=0,
        le=100_000,
        description="Sandboxes this host holds at most (live and starting); a full host takes no new one and "
        "placement sends it to another host. Size it to the host's memory over memory_mb; 0: no limit.",
    )
    staging_budget_mb: int = Field(
        8192,
        ge=16,
        le=1 << 30,
        description="Disk a host gives checkpoints between capture and upload and archives it restores or "
        "forks from (belayer/sandbox/staging.py). Over it, a capture first evicts, oldest first, staged files "
        "no trajectory can still publish; if that is not enough the checkpoint is skipped (the step goes "
        "unprotected until the next one) rather than filling the disk. Checked before each capture.",
    )
    reap_interval_s: float = Field(
        20.0,
        ge=0,
        le=3600,
        description="How often the sandbox worker removes the sandboxes whose workflow has closed (terminated "
        "from Temporal, timed out: no workflow code ran to destroy them) or that Temporal does not know; a "
        "sandbox no workflow started is never touched (belayer/sandbox/reaper.py). 0: never.",
    )
    drain_deadline_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="SIGTERM to the sandbox worker drains the host within this many seconds: every sandbox "
        "checkpointed at its next safe point and resumed on another host (belayer drain HOST sets its own). "
        "Keep it under the platform's grace period (spot warnings: 30 s to 2 min); 0 stops without draining.",
    )
    drain_concurrency: int = Field(
        2,
        ge=1,
        le=64,
        description="Sandboxes checkpointed at once by a drain (each compresses on every core).",
    )
    podman_timeout_s: float = Field(
        300.0, gt=0, le=3600, description="Upper bound of one podman call (checkpoint and restore included)."
    )

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:
        return backends.checked_name(name)

    @model_validator(mode="after")
    def _tmpfs_fit_in_memory(self) -> "SandboxConfig":
        # tmpfs pages are charged to the container's memory: full tmpfs mounts alone must
        # leave room for the processes (a full /workspace would otherwise OOM-kill PID 1).
        sized = {name: getattr(self, name) for name in TMPFS_FIELDS}
        tmpfs = sum(sized.values()) + TMPFS_FIXED_MB
        if tmpfs > self.memory_mb * 0.75:
            raise ValueError(
                f"sandbox tmpfs sizes ({' + '.join(f'{k} {v}' for k, v in sized.items())} + {TMPFS_FIXED_MB} fixed "
                f"(/var/tmp, /run/lock, /dev) = {tmpfs} MiB) exceed 3/4 of memory_mb ({self.memory_mb}); "
                f"raise sandbox.memory_mb or lower them"
            )
        return self


TMPFS_FIELDS = ("workspace_mb", "home_mb", "tmp_mb", "run_mb", "shm_mb", "journal_mb")
# /var/tmp (16), /run/lock (1) and /dev (64: runc's fixed size).
TMPFS_FIXED_MB = 16 + 1 + 64
