"""Sandbox settings: limits and runtime of the agent's containers."""

from pydantic import Field

from belayer.section import Section


class SandboxConfig(Section):
    """Per-sandbox limits and the host's task queue."""

    image: str = Field("localhost/belayer-base:v1", description="Base image every sandbox starts from.")
    memory_mb: int = Field(1024, ge=64, description="Memory limit per sandbox (MiB).")
    cpus: float = Field(1.0, gt=0, le=64, description="CPU limit per sandbox (cores).")
    pids_limit: int = Field(256, ge=16, description="Process limit per sandbox (stops fork bombs).")
    workspace_mb: int = Field(
        256, ge=16, description="Size of the /workspace tmpfs (MiB); it travels inside checkpoints."
    )
    action_timeout_s: float = Field(60.0, gt=0, description="Default per-action timeout (seconds).")
    output_cap_bytes: int = Field(
        64 * 1024, ge=1024, description="Captured stdout/stderr per action before truncation."
    )
    host_task_queue: str | None = Field(
        None, description="This host's task queue; default 'belayer-sandbox-<hostname>'."
    )
