"""Task drivers: what the trajectory loop asks of a task, one driver per task kind.

The workflows never branch on a task's type: they ask its driver (`belayer.workloads.registry`)
for the prompt's instruction, the sampling of each turn, the action a generation stands for,
when the task is done and how it is verified. A new task format is a task model (its fields,
in `tasks.py`) and a driver here, registered in `registry.DRIVERS`.

Drivers run inside Temporal workflow code, so they are pure: no I/O, no clock, no randomness,
the same answer for the same task and step on every replay. Changing what a driver answers
for an existing kind changes the workflow's commands: the checked-in replay histories
(tests/workflows/test_replay.py) are the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, Literal, Protocol, TypeVar

from belayer.agent_format import malformed_observation, parse_action
from belayer.sandbox.models import SandboxSpec, StoredFiles
from belayer.workloads.harbor_reward import task_reward
from belayer.workloads.tasks import HarborTask, ModelTask, OwnTaskBase, TaskBase, TraceTask

TaskT = TypeVar("TaskT", bound=OwnTaskBase)
TaskT_contra = TypeVar("TaskT_contra", bound=TaskBase, contravariant=True)


@dataclass(frozen=True)
class TurnSampling:
    """How the engine generates one turn: its token cap, and whether it stops at EOS."""

    max_tokens: int
    ignore_eos: bool


@dataclass(frozen=True)
class GradedCheck:
    """A check that writes its own reward (Harbor's tests): its files installed at /tests
    first, its reward read from what it wrote, any value; none written is the agent's failure."""

    tests: StoredFiles
    timeout_s: float
    reward_key: str | None
    artifacts: tuple[str, ...] = ()  # paths read back after it ran (Harbor's [[steps]].artifacts)


@dataclass(frozen=True)
class NextStage:
    """A multi-step task's next stage (Harbor's `[[steps]]` entry; "step" here is a turn):
    what is put in the sandbox and run before the agent begins it, and what it is told."""

    name: str
    instruction: str
    uploads: dict[str, StoredFiles]
    setup_commands: tuple[str, ...]
    min_reward: float | None  # the stage that ends: below it, the task stops there


@dataclass(frozen=True)
class Verification:
    """The check run after the last turn, apart from the agent's shell; its exit status 0
    is reward 1, unless it is `graded`. `processes`: what the agent left running does
    meanwhile (frozen/running)."""

    command: str
    processes: Literal["frozen", "running"]
    graded: GradedCheck | None = None


class TaskDriver(Protocol[TaskT_contra]):
    """The questions the trajectory and group workflows ask of one kind of task."""

    kind: ClassVar[str]
    """The `kind` field's value that selects this driver (also the pydantic union tag)."""
    model: ClassVar[type[TaskBase]]
    """The task model this driver reads; the workload loader validates tasks of `kind` into it."""
    implied_by: ClassVar[str | None]
    """A field whose presence selects this kind when a task names no `kind` (None: never implied)."""

    def instruction(self, task: TaskT_contra) -> str:
        """The instruction the prompt is tokenized from (one per trajectory or group)."""
        ...

    def turn_limit(self, task: TaskT_contra) -> int:
        """Turns after which the task is done, whatever the agent does."""
        ...

    def sampling(self, task: TaskT_contra, step: int) -> TurnSampling:
        """The generation of the turn after `step` turns have run."""
        ...

    def next_action(self, task: TaskT_contra, step: int, generated: str) -> str | None:
        """The command the turn after `step` runs, given what the engine generated; None when
        the agent stopped (the trajectory goes on to verification)."""
        ...

    def expected_output_tokens(self, task: TaskT_contra, step: int) -> int | None:
        """Tokens the turn after `step` will generate when the task knows (0 after its last
        turn); None when only the engine knows, and the checkpoint policy predicts."""
        ...

    def verification(self, task: TaskT_contra, stage: int = 0) -> Verification | None:
        """The check that scores the trajectory (of a multi-stage task, its `stage`'s); None:
        no check, reward 1."""
        ...

    def stages(self, task: TaskT_contra) -> int:
        """How many stages the task has, each its own turns and check (Harbor's `[[steps]]`); 1
        for every task that has none."""
        ...

    def next_stage(self, task: TaskT_contra, stage: int) -> NextStage:
        """What stage `stage` (1 or later) puts in the sandbox and tells the agent."""
        ...

    def staged_reward(self, task: TaskT_contra, rewards: list[float | None]) -> float:
        """The task's reward from its stages' (None: no reward written; fewer: it stopped early)."""
        ...

    def sandbox(self, task: TaskT_contra) -> SandboxSpec:
        """What the task's sandbox starts from (its image, setup commands, files)."""
        ...

    def action_timeout_s(self, task: TaskT_contra, stage: int = 0) -> float | None:
        """Each action's time limit; None: the sandbox's default (sandbox.action_timeout_s)."""
        ...


class _CheckedByCommand(Generic[TaskT]):
    """Verification and sandbox shared by Belayer's own kinds: the task's optional `check`
    command, the base image with the task's setup commands."""

    def sandbox(self, task: TaskT) -> SandboxSpec:
        return SandboxSpec(setup_commands=task.setup)

    def action_timeout_s(self, task: TaskT, stage: int = 0) -> float | None:
        return task.action_timeout_s

    def verification(self, task: TaskT, stage: int = 0) -> Verification | None:
        if not task.check:
            return None
        return Verification(command=task.check, processes=task.verify_with_processes)

    def stages(self, task: TaskT) -> int:
        return 1

    def next_stage(self, task: TaskT, stage: int) -> NextStage:
        raise ValueError(f"task {task.id} has one stage")

    def staged_reward(self, task: TaskT, rewards: list[float | None]) -> float:
        return rewards[0] or 0.0


class TraceDriver(_CheckedByCommand[TraceTask]):
    """Replays a recorded run: each turn generates its recorded length (EOS ignored) and runs
    its recorded command, whatever the engine said."""

    kind: ClassVar[str] = "trace"
    model: ClassVar[type[TaskBase]] = TraceTask
    implied_by: ClassVar[str | None] = "turns"

    def instruction(self, task: TraceTask) -> str:
        return f"replay trace {task.id}"

    def turn_limit(self, task: TraceTask) -> int:
        return len(task.turns)

    def sampling(self, task: TraceTask, step: int) -> TurnSampling:
        return TurnSampling(max_tokens=task.turns[step].think_tokens, ignore_eos=True)

    def next_action(self, task: TraceTask, step: int, generated: str) -> str | None:
        return task.turns[step].bash

    def expected_output_tokens(self, task: TraceTask, step: int) -> int | None:
        return task.turns[step].think_tokens if step < len(task.turns) else 0


class ModelDriver(_CheckedByCommand[ModelTask]):
    """The model acts: its output is parsed for `<bash>COMMAND</bash>` (belayer.agent_format)."""

    kind: ClassVar[str] = "model"
    model: ClassVar[type[TaskBase]] = ModelTask
    implied_by: ClassVar[str | None] = None

    def instruction(self, task: ModelTask) -> str:
        return task.instruction

    def turn_limit(self, task: ModelTask) -> int:
        return task.max_turns

    def sampling(self, task: ModelTask, step: int) -> TurnSampling:
        return TurnSampling(max_tokens=task.max_tokens_per_turn, ignore_eos=False)

    def next_action(self, task: ModelTask, step: int, generated: str) -> str | None:
        return policy_action(generated)

    def expected_output_tokens(self, task: ModelTask, step: int) -> int | None:
        return None


class HarborDriver:
    """A Harbor task (belayer.workloads.harbor_tasks): its own image run as built, its agent
    as Harbor names them, its own tests as the graded check.

    - model: the policy acts as on a model task (`<bash>COMMAND</bash>`), up to `max_turns`;
    - oracle: one turn whose action is the task's solution (`/solution/solve.sh`, installed
      at create); the turn generates one token (EOS ignored), as a trace turn does;
    - nop: no turn at all; the tests judge the image as built (a sound task scores 0)."""

    kind: ClassVar[str] = "harbor"
    model: ClassVar[type[TaskBase]] = HarborTask
    implied_by: ClassVar[str | None] = None

    def instruction(self, task: HarborTask) -> str:
        return task.instruction

    def turn_limit(self, task: HarborTask) -> int:
        return {"model": task.max_turns, "oracle": 1, "nop": 0}[task.agent]

    def sampling(self, task: HarborTask, step: int) -> TurnSampling:
        if task.agent == "model":
            return TurnSampling(max_tokens=task.max_tokens_per_turn, ignore_eos=False)
        return TurnSampling(max_tokens=1, ignore_eos=True)

    def next_action(self, task: HarborTask, step: int, generated: str) -> str | None:
        if task.agent == "oracle":
            return ORACLE_ACTION
        return policy_action(generated)

    def expected_output_tokens(self, task: HarborTask, step: int) -> int | None:
        if task.agent == "model":
            return None
        return 1 if step < self.turn_limit(task) else 0

    def verification(self, task: HarborTask, stage: int = 0) -> Verification:
        spec = task.later_steps[stage - 1] if stage else task
        return Verification(
            command=verifier_command(spec.verifier_env, task.semantics.workdir),
            processes=task.verify_with_processes,
            graded=GradedCheck(
                tests=spec.tests,
                timeout_s=spec.verifier_timeout_s,
                reward_key=task.reward_key,
                artifacts=tuple(spec.artifacts),
            ),  # fmt: skip
        )

    def stages(self, task: HarborTask) -> int:
        return 1 + len(task.later_steps)

    def next_stage(self, task: HarborTask, stage: int) -> NextStage:
        spec = task.later_steps[stage - 1]
        ending = task.min_reward if stage == 1 else task.later_steps[stage - 2].min_reward
        return NextStage(name=spec.name, instruction=spec.instruction, uploads=dict(spec.uploads),
                         setup_commands=tuple(spec.setup_commands), min_reward=ending)  # fmt: skip

    def staged_reward(self, task: HarborTask, rewards: list[float | None]) -> float:
        return task_reward(rewards, self.stages(task), task.reward_strategy)

    def sandbox(self, task: HarborTask) -> SandboxSpec:
        return SandboxSpec(setup_commands=task.setup, image=task.image, semantics=task.semantics)

    def action_timeout_s(self, task: HarborTask, stage: int = 0) -> float | None:
        return task.later_steps[stage - 1].agent_timeout_s if stage else task.agent_timeout_s


# Harbor's paths: its solutions and tests expect to be run from there.
SOLUTION_DIR = "/solution"
TESTS_DIR = "/tests"
ORACLE_ACTION = f"bash {SOLUTION_DIR}/solve.sh"


def verifier_command(env: dict[str, str], workdir: str) -> str:
    """A Harbor step's tests as the verifier runs them: its `[verifier].env` exported, in the WORKDIR."""
    exports = "".join(f"export {name}={shell_quote(value)}\n" for name, value in env.items())
    return f"{exports}cd {shell_quote(workdir)} && bash {TESTS_DIR}/test.sh"


def policy_action(generated: str) -> str | None:
    """The command a policy's generation asks for (`<bash>COMMAND</bash>`), None when it
    stopped; a malformed one becomes a harmless action that shows the model what was wrong
    (a policy outcome, not an error)."""
    parsed = parse_action(generated)
    if parsed.kind == "stop":
        return None
    if parsed.kind == "malformed":
        return "printf '%s\\n' " + shell_quote(malformed_observation(parsed))
    return parsed.command


def shell_quote(text: str) -> str:
    """`text` as one single-quoted shell word."""
    return "'" + text.replace("'", "'\\''") + "'"
