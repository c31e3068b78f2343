"""How often a model solves the multistep tasks with its observations, and with them blanked.

The ablation behind the multistep family's claim: a policy that does not read what its
actions observed cannot succeed. Each task is played turn by turn with transformers at
temperature 1 over the full vocabulary (what the rollout engine does), seeded, against a
stand-in for the sandbox that answers exactly the commands the family's solution uses:
`ls` of the task's folders (what `ls` prints there, or its error) and the compute command
(evaluated for the number the check expects). Any other command fails the task. With
`blank=True` every observation the model reads is `[exit 0]` alone. No vLLM, no sandbox:
the training run's reward comes from real sandboxes; this measures one checkpoint.

    python -m belayer.model.multistep_eval MODEL [SAMPLES]

MODEL is a project model name (`tiny-agent`) or a folder (`belayer model export RUN --out
DIR`); it prints the success rate per split, with and without observations.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from belayer.agent_format import PROMPT_TEMPLATE, parse_action
from belayer.model.build import MODEL_NAMES, model_path
from belayer.model.evaluate import load, sample_turns
from belayer.model.learn_tasks import apply
from belayer.model.multistep_tasks import (
    MAX_TURNS,
    OUTPUT,
    ROOT,
    SPLITS,
    Problem,
    observation,
    problems,
)

_COMPUTE = re.compile(
    rf"echo \$\(\(\$\(cat {ROOT}/(?P<folder>\w+)/(?P<file>\w+)\) (?P<op>[-+*]) (?P<k>\d+)\)\) > {OUTPUT}"
)


@dataclass
class StandIn:
    """The sandbox as far as the family's solution reaches it; remembers the output."""

    problem: Problem
    output: int | None = None

    def run(self, command: str) -> str:
        if command.startswith("ls "):
            return observation(*self.problem.listing(command))
        match = _COMPUTE.fullmatch(command)
        if not match:
            return observation(stderr=f"{command.split()[0]}: not part of this task\n", exit_code=127)
        found = (match["folder"], match["file"]) == (self.problem.folder, self.problem.file)
        if not found:
            return observation(stderr="cat: No such file or directory\n", exit_code=1)
        self.output = apply(match["op"], self.problem.value, int(match["k"]))
        return observation()

    @property
    def solved(self) -> bool:
        return self.output == self.problem.expected


def play(model, tokenizer, problem: Problem, seed: int, *, blank: bool = False) -> tuple[bool, list[str]]:
    """One trajectory of `problem`: whether it solved the task, and its commands."""
    import torch  # import cost: torch, ~2.5 s

    shell = StandIn(problem)
    context = tokenizer.encode(
        PROMPT_TEMPLATE.format(instruction=problem.instruction), add_special_tokens=False
    ).ids
    commands: list[str] = []
    torch.manual_seed(seed)
    for _ in range(MAX_TURNS):
        (turn,) = sample_turns(model, context, 1)
        context += turn
        action = parse_action(tokenizer.decode(turn, skip_special_tokens=True))
        if action.kind != "bash":
            break
        commands.append(action.command)
        shown = shell.run(action.command)
        context += tokenizer.encode(observation() if blank else shown, add_special_tokens=False).ids
    return shell.solved, commands


def success_rate(
    model, tokenizer, tasks: list[Problem], samples: int, *, seed: int = 1, blank: bool = False
) -> float:
    """The fraction of `samples` trajectories per task that solved it."""
    wins = sum(
        play(model, tokenizer, problem, seed + i * samples + j, blank=blank)[0]
        for i, problem in enumerate(tasks)
        for j in range(samples)
    )
    return wins / (samples * len(tasks))


def main(name: str = "tiny-agent", samples: int = 2) -> None:
    folder = model_path(name, progress=print) if name in MODEL_NAMES else Path(name)  # type: ignore[arg-type]
    model, tokenizer = load(folder)
    for split in SPLITS:
        tasks = problems(split)
        seen = success_rate(model, tokenizer, tasks, samples)
        blanked = success_rate(model, tokenizer, tasks, samples, blank=True)
        print(f"{name} {split}: solved {seen:.2f} with observations, {blanked:.2f} with them blanked")


if __name__ == "__main__":
    main(*sys.argv[1:2], *[int(a) for a in sys.argv[2:3]])
