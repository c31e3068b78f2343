"""The learn task family: generated workloads are current, valid, and their checks judge
the sandbox state the way the task says."""

import subprocess
from pathlib import Path

import pytest

from belayer.model import learn_tasks
from belayer.model.learn_tasks import OPERATIONS, SPLITS, WRONG_OUTPUT, problems, render_workload
from belayer.workloads.loader import load_workload

WORKLOADS = Path(__file__).resolve().parents[2] / "examples" / "workloads"


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_workload_files_are_up_to_date(split):
    path = WORKLOADS / SPLITS[split][0]
    assert path.read_text(encoding="utf-8") == render_workload(split), (
        "regenerate with: python -m belayer.model.learn_tasks examples/workloads"
    )
    workload = load_workload(path)
    assert len(workload.tasks) == SPLITS[split][1]
    assert all(t.max_turns == 2 and t.max_tokens_per_turn <= 48 for t in workload.tasks)


def test_heldout_prompts_are_new_pairs_of_constants_trained_with_every_other_operation():
    train = {(p.operation, p.constant) for p in problems("train")}
    heldout = [(p.operation, p.constant) for p in problems("heldout")]
    assert len(set(heldout)) == len(heldout) and len(train) == SPLITS["train"][1]
    assert not train & set(heldout), "a held-out prompt is one RL trains on"
    for operation, constant in heldout:
        assert {op for op, k in train if k == constant} == set(OPERATIONS) - {operation}
    # No constant tells the operation in the train split: each comes with two or three.
    for constant in {k for _, k in train}:
        assert len({op for op, k in train if k == constant}) >= 2


def _reward(task: dict, command: str, workspace: Path) -> bool:
    """Run setup, the command and the check with /workspace mapped to a temp folder."""
    workspace.mkdir()

    def run(line):
        return subprocess.run(
            ["bash", "-c", line.replace("/workspace", str(workspace))], check=False
        ).returncode

    for line in task["setup"]:
        assert run(line) == 0
    run(command)
    return run(task["check"]) == 0


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.usefixtures("local_processes")
def test_only_the_correct_command_earns_the_reward(split, tmp_path):
    problem = problems(split)[0]
    task = learn_tasks.task(problem, 0)
    wrong = [
        problem.command(constant=problem.constant + 1),
        problem.command(symbol=problem.wrong_symbol()),
        problem.command(dst=WRONG_OUTPUT),
    ]
    for i, command in enumerate([problem.command(), *wrong]):
        assert _reward(task, command, tmp_path / str(i)) == (i == 0), command
