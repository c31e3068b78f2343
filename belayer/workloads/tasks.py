"""The task models of each kind: the fields a workload's task of that kind has.

A workload is a YAML file (`tasks: [...]`) or a JSONL file (one task per line). Two
kinds of task, told apart by their fields (or an explicit `kind`):

- trace task — replays a recorded agent run: for each turn the engine really generates
  `think_tokens` tokens (EOS ignored), then `bash` runs as the action.
- model task — the model acts: its output is parsed for `<bash>COMMAND</bash>`.
- harbor task — a Harbor task directory, made into a task by `belayer.workloads.harbor_tasks`
  (its image built, its tests and solution put in the store): never written by hand.

Both may have `setup` (commands run when the sandbox is created) and `check` (exit
status 0 means reward 1). What the workflows do with each kind is its driver's
(`drivers.py`); the kinds are registered in `registry.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer.sandbox.models import ImageSemantics, StoredFiles

TASK_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceTurn(_Strict):
    """One recorded turn: generation length, then the action."""

    think_tokens: int = Field(ge=0, le=32768, description="Tokens the engine generates (EOS ignored).")
    bash: str = Field(min_length=1, description="The action run in the sandbox after generating.")


class TaskBase(_Strict):
    id: str = Field(pattern=TASK_ID_PATTERN, description="Unique within the workload; in workflow ids.")
    setup: list[str] = Field(default_factory=list, description="Commands run when the sandbox is created.")
    check: str | None = Field(None, description="Command whose exit status 0 means reward 1.")
    verify_with_processes: Literal["frozen", "running"] = Field(
        "frozen",
        description="The agent's processes during the check: frozen (default: nothing the agent "
        "left running can change what the check reads or writes), or running (a check that queries a "
        "server the agent started; such a check can be raced by the agent's processes).",
    )


class OwnTaskBase(TaskBase):
    """The fields of Belayer's own kinds (a Harbor task takes its limits from task.toml)."""

    action_timeout_s: float | None = Field(
        None, gt=0, le=86400, description="Each action's time limit; default sandbox.action_timeout_s."
    )


class TraceTask(OwnTaskBase):
    kind: Literal["trace"] = "trace"
    turns: list[TraceTurn] = Field(min_length=1, description="The recorded turns, in order.")


class ModelTask(OwnTaskBase):
    kind: Literal["model"] = "model"
    instruction: str = Field(min_length=1, description="What the agent is asked to do.")
    max_turns: int = Field(8, ge=1, le=10_000, description="Turns before the trajectory stops.")
    max_tokens_per_turn: int = Field(256, ge=1, le=32768, description="Generation cap per turn.")


HarborAgent = Literal["model", "oracle", "nop"]


class HarborStepSpec(_Strict):
    """A later step of a multi-step Harbor task ([[steps]] after the first): what the agent is
    told when it begins, what is put in the sandbox first, how it is judged."""

    name: str
    instruction: str = Field(min_length=1)
    tests: StoredFiles
    uploads: dict[str, StoredFiles] = Field(
        default_factory=dict, description="Installed before the step begins (its solution, its staged files)."
    )
    setup_commands: list[str] = Field(
        default_factory=list, description="Run as the agent before it begins (its workdir/ files, setup.sh)."
    )
    agent_timeout_s: float = Field(600.0, gt=0)
    verifier_timeout_s: float = Field(600.0, gt=0)
    verifier_env: dict[str, str] = Field(default_factory=dict)
    min_reward: float | None = Field(None, description="Below it, the task stops after this step.")
    artifacts: list[str] = Field(default_factory=list, description="Paths collected after its check.")


class HarborTask(TaskBase):
    """A Harbor task as the workflows run it: pointers and hashes (its image's tag, its tests'
    and solution's tars in the store), never its files. Built by `harbor_tasks.py`."""

    kind: Literal["harbor"] = "harbor"
    instruction: str = Field(min_length=1, description="instruction.md: the agent's prompt.")
    image: str = Field(min_length=1, description="The task image's tag (built or `docker_image`).")
    semantics: ImageSemantics = Field(description="How the image runs: users, WORKDIR, env, uploads.")
    agent: HarborAgent = Field("model", description="model (the policy), oracle (solve.sh) or nop.")
    verify_with_processes: Literal["frozen", "running"] = Field(
        "running", description="Harbor's semantics: the agent's processes keep running while its tests do."
    )
    max_turns: int = Field(8, ge=1, le=10_000, description="Turns of the model agent.")
    max_tokens_per_turn: int = Field(256, ge=1, le=32768, description="Generation cap per turn.")
    agent_timeout_s: float = Field(600.0, gt=0, description="[agent].timeout_sec: each action's limit.")
    tests: StoredFiles = Field(description="tests/, installed at /tests when the verifier runs.")
    verifier_timeout_s: float = Field(600.0, gt=0, description="[verifier].timeout_sec.")
    verifier_env: dict[str, str] = Field(default_factory=dict, description="[verifier].env.")
    reward_key: str | None = Field(None, description="The reward.json key that is the reward.")
    notes: list[str] = Field(default_factory=list, description="Warnings recorded in the result.")
    storage_mb: int | None = Field(
        None, description="[environment].storage_mb when declared: not enforced here, its measured use noted."
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="[metadata], kept and shown.")
    step_name: str | None = Field(
        None, description="A multi-step task's first step (its fields are the above)."
    )
    min_reward: float | None = Field(None, description="The first step's: below it, the task stops there.")
    artifacts: list[str] = Field(
        default_factory=list,
        description="The first step's paths collected after its check (files or directories).",
    )
    later_steps: list[HarborStepSpec] = Field(default_factory=list, description="The steps after the first.")
    reward_strategy: Literal["mean", "final"] = Field(
        "mean",
        description="A multi-step task's reward: the mean of its steps' (one not run: 0), or the last's.",
    )
