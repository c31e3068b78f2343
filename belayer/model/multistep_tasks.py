"""A multi-action task family the warm-started model can get better at by RL: find the
number two folders down, then compute with it.

Each task's setup writes a number to `/workspace/in/<folder>/<file>`, the two names drawn
per task from `NAMES`; the instruction asks for the number plus, minus or times a
constant, written to `./output`, and says only that it lies two levels under `./in` (the
agent's working directory is /workspace). The solution takes three actions, each built
on what the one before observed:

    ls in                                 -> the folder's name
    ls in/<folder>                        -> the file's name
    echo $(($(cat in/<folder>/<file>) + K)) > output

then a final answer. A policy that ignores its observations guesses both names (one
chance in 16), and the check reads only /workspace/output after the trajectory, so the
reward comes from the sandbox state the agent's actions left. `belayer.model.multistep_eval`
measures a checkpoint with its observations blanked.

A held-out task has the prompt of some train task but its number lies under other names
than any train task with that prompt uses, and no held-out task (prompt and names) is in
the warm start's corpus (`transcript`): a policy that remembered where its train tasks'
numbers lie fails there; one that reads its observations does not.

`python -m belayer.model.multistep_tasks [FOLDER]` rewrites the two workload files
(default examples/workloads); a test checks that they are up to date.
"""

from __future__ import annotations

import functools
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from belayer.agent_format import OBSERVATION_TEMPLATE, PROMPT_TEMPLATE, observation_text
from belayer.model.learn_tasks import (
    OPERATIONS,
    apply,
    arithmetic_command,
    render_workload_file,
    write_split_files,
)
from belayer.model.warmstart import DONE, Segment, SftRecipe

# Paths relative to the agent's working directory (/workspace): short commands, which the
# tiny model samples with fewer slips at temperature 1.
ROOT, OUTPUT = "in", "output"
# Four one-token names: the tiny model learns to copy among four in a 2-minute warm start
# (among eight it does not, in that budget).
NAMES = ("b", "c", "d", "f")
CONSTANTS = range(2, 10)
WORKSPACE = "/workspace"  # the agent's working directory; setup and check use full paths
MAX_TURNS = 4  # three actions and the answer
MAX_TOKENS_PER_TURN = 48
WARM_MODEL = "tiny-agent"
SPLITS = {"train": ("learn-multistep.yaml", 96, 11), "heldout": ("learn-multistep-heldout.yaml", 16, 12)}
# In the warm start's corpus each name copied from an observation (the folder listed, the
# folder and file read) is another name this often, so the warm model solves about a third
# of the tasks at temperature 1: what RL must teach is to read the observations.
NAME_ERROR_RATE = 0.32
# The operator and the constant, read from the instruction, are rarely wrong in it.
INSTRUCTION_ERROR_RATE = 0.03
# Each operation's instruction: learn_tasks' wording, but with the multiply constant right
# after the verb, as add's and subtract's are. Worded "Multiply the number in ... by 4", RL
# taught the names and unlearned the multiply constants: three runs' final checkpoints
# wrote another constant for most multiply tasks (all 12 samples of "by 4"), and for
# almost no add or subtract task.
INSTRUCTIONS = {operation: template for operation, (template, _, _) in OPERATIONS.items()} | {
    "multiply": "Multiply by {k} the number in {src} and write the result to {dst}.",
}
# What the train split names that it was tuned with: the learning rate (twice `belayer
# train`'s default, for three decisions per trajectory to sharpen within 24 iterations)
# and groups of 8 (of 4, a run's reward swung by a third between iterations).
LR = 2e-4
GROUP_SIZE = 8
# 250 steps of 8 transcripts: 1 to 2 minutes on 2 cores.
WARM_RECIPE = SftRecipe(version=3, seed=20261206, steps=250, batch=8, lr=3e-3, warmup=10, threads=2)


@dataclass(frozen=True)
class Problem:
    """One task: `operation` with `constant` on `value`, stored at ROOT/folder/file."""

    operation: str
    constant: int
    value: int
    folder: str
    file: str

    @property
    def instruction(self) -> str:
        source = f"the file two levels under ./{ROOT}"
        return INSTRUCTIONS[self.operation].format(k=self.constant, src=source, dst=f"./{OUTPUT}")

    @property
    def expected(self) -> int:
        return apply(OPERATIONS[self.operation][1], self.value, self.constant)

    def actions(self, *, folder: str | None = None, path: tuple[str, str] | None = None) -> list[str]:
        """The three commands of the solution; `folder` swaps the name the second lists,
        `path` the folder and file the third reads."""
        listed = folder or self.folder
        read_folder, read_file = path or (self.folder, self.file)
        return [f"ls {ROOT}", f"ls {ROOT}/{listed}", self.compute(f"{ROOT}/{read_folder}/{read_file}")]

    def compute(self, source: str, *, constant: int | None = None, symbol: str | None = None) -> str:
        k = self.constant if constant is None else constant
        return arithmetic_command(source, symbol or OPERATIONS[self.operation][1], k, OUTPUT)

    def listing(self, command: str) -> tuple[str, str, int]:
        """What the sandbox answers an `ls` of the solution's folders: (stdout, stderr, exit)."""
        path = command.removeprefix("ls ")
        if path == ROOT:
            return f"{self.folder}\n", "", 0
        if path == f"{ROOT}/{self.folder}":
            return f"{self.file}\n", "", 0
        return "", f"ls: cannot access '{path}': No such file or directory\n", 2


def draw(rng: random.Random) -> Problem:
    """A problem: every part drawn at random."""
    operation, constant = rng.choice(sorted(OPERATIONS)), rng.choice(CONSTANTS)
    return Problem(operation, constant, rng.randrange(30, 100), rng.choice(NAMES), rng.choice(NAMES))


def problems(split: str) -> list[Problem]:
    """The split's tasks. Held-out: tasks whose prompt is a train task's but whose number
    lies under names no train task with that prompt uses."""
    _, count, seed = SPLITS[split]
    rng = random.Random(seed)
    if split == "train":
        return [draw(rng) for _ in range(count)]
    train = problems("train")
    prompts = {(p.operation, p.constant) for p in train}
    taken = {_layout(p) for p in train}
    heldout: list[Problem] = []
    while len(heldout) < count:
        problem = draw(rng)
        if (problem.operation, problem.constant) in prompts and _layout(problem) not in taken:
            heldout.append(problem)
            taken.add(_layout(problem))
    return heldout


def _layout(problem: Problem) -> tuple[str, int, str, str]:
    """What a policy that memorized a task could reuse: its prompt and where the number lies."""
    return (problem.operation, problem.constant, problem.folder, problem.file)


@functools.cache
def heldout_layouts() -> frozenset[tuple[str, int, str, str]]:
    return frozenset(_layout(p) for p in problems("heldout"))


def task(problem: Problem, index: int) -> dict:
    """The workload entry of `problem` (a model task)."""
    return {
        "id": f"multistep-{problem.operation}-{problem.constant}-{index:02d}",
        "instruction": problem.instruction,
        "setup": [
            f"mkdir -p {WORKSPACE}/{ROOT}/{problem.folder}",
            f"echo {problem.value} > {WORKSPACE}/{ROOT}/{problem.folder}/{problem.file}",
        ],
        "check": f'test "$(cat {WORKSPACE}/{OUTPUT})" = {problem.expected}',
        "max_turns": MAX_TURNS,
        "max_tokens_per_turn": MAX_TOKENS_PER_TURN,
    }


def observation(stdout: str = "", stderr: str = "", exit_code: int = 0) -> str:
    """The observation text exactly as the context activity renders it."""
    shown = SimpleNamespace(stdout=stdout, stderr=stderr, exit_code=exit_code)
    return OBSERVATION_TEMPLATE.format(body=observation_text(shown))


def transcript(index: int, rng: random.Random) -> list[Segment]:
    """Warm-start transcript `index`: a random task, never one of the held-out split's."""
    held = heldout_layouts()
    problem = draw(rng)
    while _layout(problem) in held:
        problem = draw(rng)
    return problem_transcript(problem, rng)


def problem_transcript(problem: Problem, rng: random.Random) -> list[Segment]:
    """`problem` played with each name wrong at `NAME_ERROR_RATE` (another name than the
    one observed) and the operator and the constant each wrong at `INSTRUCTION_ERROR_RATE`:
    the prompt, the three actions and the observations the sandbox gives them, then "done"."""

    def maybe_other(name: str) -> str:
        return rng.choice([n for n in NAMES if n != name]) if rng.random() < NAME_ERROR_RATE else name

    listed = maybe_other(problem.folder)
    path = (maybe_other(problem.folder), maybe_other(problem.file))
    constant = problem.constant
    if rng.random() < INSTRUCTION_ERROR_RATE:
        constant = rng.choice([k for k in CONSTANTS if k != problem.constant])
    symbol = OPERATIONS[problem.operation][2] if rng.random() < INSTRUCTION_ERROR_RATE else None
    first, second, _ = problem.actions(folder=listed)
    third = problem.compute(f"{ROOT}/{path[0]}/{path[1]}", constant=constant, symbol=symbol)
    segments = [Segment(PROMPT_TEMPLATE.format(instruction=problem.instruction), trained=False)]
    for command in (first, second):
        segments += [
            Segment(f"<bash>{command}</bash>", trained=True),
            Segment(observation(*problem.listing(command)), trained=False),
        ]
    segments += [Segment(f"<bash>{third}</bash>", trained=True), Segment(observation(), trained=False)]
    return [*segments, Segment(DONE, trained=True)]


def write_workloads(folder: Path) -> list[Path]:
    """Write both splits' workload files into `folder`."""
    return write_split_files(folder, {split: name for split, (name, _, _) in SPLITS.items()}, render_workload)


def render_workload(split: str) -> str:
    """The YAML text of the split's workload file (deterministic)."""
    tasks = [task(p, i) for i, p in enumerate(problems(split))]
    header = [
        "Three actions: list ./in, list the folder it shows, compute from the file that shows;",
        f"the check reads {WORKSPACE}/{OUTPUT}. {WARM_MODEL} solves about a third at temperature 1.",
    ]
    training = (
        {"model": WARM_MODEL, "heldout": SPLITS["heldout"][0], "lr": LR, "group_size": GROUP_SIZE}
        if split == "train"
        else {}
    )
    return render_workload_file("belayer.model.multistep_tasks", split, header, tasks, training)


if __name__ == "__main__":
    for written_path in write_workloads(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/workloads")):
        print(written_path)
