"""Workload files: the tasks `belayer run` starts trajectories for.

A workload is a YAML file (`tasks: [...]`) or a JSONL file (one task per line). Two
kinds of task, told apart by their fields (or an explicit `kind`):

- trace task — replays a recorded agent run: for each turn the engine really generates
  `think_tokens` tokens (EOS ignored), then `bash` runs as the action.
- model task — the model acts: its output is parsed for `<bash>COMMAND</bash>`.

Both may have `setup` (commands run when the sandbox is created) and `check` (exit
status 0 means reward 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from belayer.model.build import ModelSize

TASK_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceTurn(_Strict):
    """One recorded turn: generation length, then the action."""

    think_tokens: int = Field(ge=0, le=32768, description="Tokens the engine generates (EOS ignored).")
    bash: str = Field(min_length=1, description="The action run in the sandbox after generating.")


class _TaskBase(_Strict):
    id: str = Field(pattern=TASK_ID_PATTERN, description="Unique within the workload; in workflow ids.")
    setup: list[str] = Field(default_factory=list, description="Commands run when the sandbox is created.")
    check: str | None = Field(None, description="Command whose exit status 0 means reward 1.")
    verify_with_processes: Literal["frozen", "running"] = Field(
        "frozen", description="The agent's processes during the check: frozen (default: nothing the agent "
        "left running can change what the check reads or writes), or running (a check that queries a "
        "server the agent started; such a check can be raced by the agent's processes).",
    )


class TraceTask(_TaskBase):
    kind: Literal["trace"] = "trace"
    turns: list[TraceTurn] = Field(min_length=1, description="The recorded turns, in order.")


class ModelTask(_TaskBase):
    kind: Literal["model"] = "model"
    instruction: str = Field(min_length=1, description="What the agent is asked to do.")
    max_turns: int = Field(8, ge=1, le=10_000, description="Turns before the trajectory stops.")
    max_tokens_per_turn: int = Field(256, ge=1, le=32768, description="Generation cap per turn.")


def _task_kind(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        return getattr(value, "kind", None)
    if not isinstance(value, dict):
        return None
    if "kind" in value:
        return value["kind"]
    return "trace" if "turns" in value else "model"


Task = Annotated[
    Annotated[TraceTask, Tag("trace")] | Annotated[ModelTask, Tag("model")],
    Discriminator(_task_kind),
]


class Workload(_Strict):
    """A validated workload: at least one task, unique ids."""

    tasks: list[Task] = Field(min_length=1)
    model: ModelSize | None = Field(
        None, description="The project-built model the tasks were made for; `belayer train` starts from it "
        "(and publishes it into the engines) instead of the stack's served model."
    )
    heldout: Path | None = Field(
        None, description="A workload of held-out tasks `belayer train` evaluates every iteration "
        "(relative to this file)."
    )
