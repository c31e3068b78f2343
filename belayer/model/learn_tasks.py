"""A task family the warm-started model can get better at by RL: arithmetic on a number
that only the sandbox holds.

Each task's setup writes a number to /workspace/input; the instruction asks for it to be
added to, subtracted from or multiplied by a constant and written to /workspace/output;
the check compares that file with the expected number. The model never sees the number,
so the reward comes only from what its command did in the sandbox, and the right command
depends on the task (the operation and the constant).

The held-out split holds one operation-constant pair for each of a few constants; the
train split holds every other pair. So a held-out prompt is one RL never trains on, each
of its constants is trained with both other operations, and no constant tells the train
split's operation: a gain on held-out is a gain in reading the instruction (which
operator, which file, which constant), not in remembering the trained prompts. (A train
split where a constant came with one operation only taught exactly that shortcut: the
held-out reward rose, then fell as RL made the model write the trained operator.)

`python -m belayer.model.learn_tasks [FOLDER]` rewrites the two workload files
(default examples/workloads); a test checks that they are up to date.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

INPUT, OUTPUT = "/workspace/input", "/workspace/output"
# Where a wrong-file command writes: a plausible name the check never looks at.
WRONG_OUTPUT = "/workspace/result"
# The family's constants. The warm start covers them all, but the tiny model copies some
# of them badly, and RL on one constant sharpens the copy of that constant; so the held-out
# split tests new operation-constant pairs, not constants RL never saw.
CONSTANTS = range(2, 30)
MAX_TURNS = 2
WARM_MODEL = "tiny-warm"
MAX_TOKENS_PER_TURN = 48

# operation: (instruction, shell operator, the operator a wrong command uses instead)
OPERATIONS = {
    "add": ("Add {k} to the number in {src} and write the result to {dst}.", "+", "-"),
    "subtract": ("Subtract {k} from the number in {src} and write the result to {dst}.", "-", "+"),
    "multiply": ("Multiply the number in {src} by {k} and write the result to {dst}.", "*", "+"),
}
HELDOUT_PAIRS = 8
SPLITS = {
    "train": ("learn.yaml", len(OPERATIONS) * len(CONSTANTS) - HELDOUT_PAIRS, 1),
    "heldout": ("learn-heldout.yaml", HELDOUT_PAIRS, 2),
}  # file, tasks, seed


def apply(symbol: str, value: int, constant: int) -> int:
    """`value symbol constant`, as the shell's `$((...))` computes it."""
    return {"+": value + constant, "-": value - constant, "*": value * constant}[symbol]


def arithmetic_command(source: str, symbol: str, constant: int, dst: str) -> str:
    """The command that writes `(number in source) symbol constant` to `dst`."""
    return f"echo $(($(cat {source}) {symbol} {constant})) > {dst}"


@dataclass(frozen=True)
class Problem:
    """One arithmetic task: `operation` with `constant` on `value` (which only setup sees)."""

    operation: str
    constant: int
    value: int

    @property
    def instruction(self) -> str:
        return OPERATIONS[self.operation][0].format(k=self.constant, src=INPUT, dst=OUTPUT)

    @property
    def expected(self) -> int:
        return apply(OPERATIONS[self.operation][1], self.value, self.constant)

    def command(self, *, constant: int | None = None, symbol: str | None = None, dst: str = OUTPUT) -> str:
        """The correct command; a keyword swaps in a wrong constant, operator or file."""
        k = self.constant if constant is None else constant
        return arithmetic_command(INPUT, symbol or OPERATIONS[self.operation][1], k, dst)

    def wrong_symbol(self) -> str:
        return OPERATIONS[self.operation][2]


def problems(split: str) -> list[Problem]:
    """The split's tasks, values drawn from the split's seed. Held-out: one pair for each of
    `HELDOUT_PAIRS` distinct constants, operations in turn; train: every other pair, shuffled."""
    _, _, seed = SPLITS[split]
    rng = random.Random(seed)
    heldout = heldout_pairs()
    if split == "heldout":
        pairs = heldout
    else:
        pairs = [(op, k) for op in sorted(OPERATIONS) for k in CONSTANTS if (op, k) not in heldout]
        rng.shuffle(pairs)
    return [Problem(op, k, rng.randrange(30, 100)) for op, k in pairs]


def heldout_pairs() -> list[tuple[str, int]]:
    """The held-out (operation, constant) pairs: distinct constants, operations in turn."""
    rng = random.Random(SPLITS["heldout"][2])
    constants = rng.sample(list(CONSTANTS), HELDOUT_PAIRS)
    ops = sorted(OPERATIONS)
    return [(ops[i % len(ops)], k) for i, k in enumerate(constants)]


def task(problem: Problem, index: int) -> dict:
    """The workload entry of `problem` (a model task)."""
    return {
        "id": f"learn-{problem.operation}-{problem.constant}-{index:02d}",
        "instruction": problem.instruction,
        "setup": [f"echo {problem.value} > {INPUT}"],
        "check": f'test "$(cat {OUTPUT})" = {problem.expected}',
        "max_turns": MAX_TURNS,
        "max_tokens_per_turn": MAX_TOKENS_PER_TURN,
    }


def render_workload(split: str) -> str:
    """The YAML text of the split's workload file (deterministic)."""
    tasks = [task(p, i) for i, p in enumerate(problems(split))]
    header = [
        "Arithmetic on a number only the sandbox holds: the check reads /workspace/output.",
        "tiny-warm solves about a third of these at temperature 1: RL can sharpen it.",
    ]
    # The train split names what `belayer train` needs beside its tasks: the warm-started
    # model to start from and the held-out split to evaluate every iteration.
    training = {"model": WARM_MODEL, "heldout": SPLITS["heldout"][0]} if split == "train" else {}
    return render_workload_file("belayer.model.learn_tasks", split, header, tasks, training)


def render_workload_file(
    module: str, split: str, header: list[str], tasks: list[dict], training: dict
) -> str:
    """A generated workload file: a header naming the generator, then the training keys
    (`model`, `heldout`, and what the tasks were tuned with) and the tasks."""
    lines = [f"Generated by `python -m {module}` ({split} split); do not edit.", *header]
    comment = "".join(f"# {line}\n" for line in lines)
    return comment + yaml.safe_dump({**training, "tasks": tasks}, sort_keys=False, width=1000)


def write_workloads(folder: Path) -> list[Path]:
    """Write both splits' workload files into `folder`."""
    return write_split_files(folder, {split: name for split, (name, _, _) in SPLITS.items()}, render_workload)


def write_split_files(folder: Path, files: dict[str, str], render: Callable[[str], str]) -> list[Path]:
    """Write `render(split)` to `folder / files[split]` for each split; the paths written."""
    written = []
    for split, name in files.items():
        path = folder / name
        path.write_text(render(split), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write_workloads(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/workloads")):
        print(written_path)
