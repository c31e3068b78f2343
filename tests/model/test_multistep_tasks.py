"""The multistep task family: generated workloads are current, no held-out task (its
prompt and where its number lies) is in the train split or the warm start's corpus, the
solution takes three actions that each need the one before's observation, and the
evaluator's stand-in answers as the shell does."""

import random
import re
import subprocess
from pathlib import Path

import pytest

from belayer.model import multistep_tasks
from belayer.model.multistep_eval import StandIn
from belayer.model.multistep_tasks import (
    MAX_TURNS,
    NAMES,
    ROOT,
    SPLITS,
    heldout_layouts,
    problem_transcript,
    problems,
    render_workload,
    transcript,
)
from belayer.workloads.loader import load_workload

WORKLOADS = Path(__file__).resolve().parents[2] / "examples" / "workloads"


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_workload_files_are_up_to_date(split):
    path = WORKLOADS / SPLITS[split][0]
    assert path.read_text(encoding="utf-8") == render_workload(split), (
        "regenerate with: python -m belayer.model.multistep_tasks examples/workloads"
    )
    workload = load_workload(path)
    assert len(workload.tasks) == SPLITS[split][1]
    assert all(t.max_turns == MAX_TURNS for t in workload.tasks)


def test_the_train_workload_names_its_model_and_heldout_split():
    workload = load_workload(WORKLOADS / SPLITS["train"][0])
    assert workload.model == "tiny-agent"
    assert workload.heldout == WORKLOADS / SPLITS["heldout"][0]
    assert workload.lr == multistep_tasks.LR


def _layout_of(segments) -> tuple[str, int, str, str] | None:
    """(operation, constant, folder, file) a transcript shows, when both its listings did."""
    prompt = segments[0].text
    verb, constant = re.search(r"Task: (Add|Subtract|Multiply)\D*(\d+)", prompt).groups()
    shown = [line for s in segments[1:] if not s.trained for line in s.text.splitlines() if line in NAMES]
    return (verb.lower(), int(constant), *shown) if len(shown) == 2 else None


def test_heldout_tasks_share_train_prompts_but_never_a_train_or_corpus_layout():
    train, heldout = problems("train"), problems("heldout")
    assert {(p.operation, p.constant) for p in heldout} <= {(p.operation, p.constant) for p in train}
    layouts = {(p.operation, p.constant, p.folder, p.file) for p in heldout}
    assert len(layouts) == len(heldout) and layouts == heldout_layouts()
    assert not layouts & {(p.operation, p.constant, p.folder, p.file) for p in train}
    rng = random.Random(0)
    corpus = {_layout_of(transcript(i, rng)) for i in range(3000)} - {None}
    assert len(corpus) > 300 and not corpus & layouts, "a held-out task is in the warm start's corpus"


def test_transcripts_mix_correct_solutions_with_each_kind_of_slip():
    rng = random.Random(1)
    played = [(p, problem_transcript(p, rng)) for p in (multistep_tasks.draw(rng) for _ in range(400))]
    solved = 0
    for problem, segments in played:
        shell = StandIn(problem)
        commands = [s.text.removeprefix("<bash>").removesuffix("</bash>") for s in segments if s.trained]
        assert commands[0] == f"ls {ROOT}" and commands[-1] == "done"
        for command in commands[:3]:
            shell.run(command)
        solved += shell.solved
    # about 0.68**3 * 0.97**2 (names wrong 32% of the time, operator and constant 3%): a
    # mixture RL can sharpen
    assert 0.25 < solved / len(played) < 0.5, solved
    assert len({segments[5].text for _, segments in played}) > 100


def _shell(task: dict, commands: list[str], workspace: Path) -> tuple[list[str], bool]:
    """Run the task's setup, then `commands` in the workspace as the agent's cwd, then the
    check, with /workspace mapped to a temp folder: (each command's stdout, rewarded)."""
    workspace.mkdir()

    def run(line, cwd=None):
        return subprocess.run(
            ["bash", "-c", line.replace("/workspace", str(workspace))],
            cwd=cwd,
            capture_output=True,
            text=True,
        )

    for line in task["setup"]:
        assert run(line).returncode == 0
    outputs = [run(command, cwd=workspace).stdout for command in commands]
    return outputs, run(task["check"]).returncode == 0


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.usefixtures("local_processes")
def test_only_the_three_actions_built_on_their_observations_earn_the_reward(split, tmp_path):
    problem = problems(split)[0]
    task = multistep_tasks.task(problem, 0)
    outputs, rewarded = _shell(task, problem.actions(), tmp_path / "right")
    assert rewarded
    assert outputs[:2] == [f"{problem.folder}\n", f"{problem.file}\n"]  # what the next action needs
    other = next(n for n in NAMES if n != problem.folder)
    blind = [
        problem.actions(path=(other, problem.file)),  # ignored the first listing
        problem.actions(path=(problem.folder, next(n for n in NAMES if n != problem.file))),  # the second
        [problem.compute(f"{ROOT}/{problem.folder}/{problem.file}", constant=problem.constant + 1)],
    ]
    for i, commands in enumerate(blind):
        assert not _shell(task, commands, tmp_path / str(i))[1], commands


@pytest.mark.usefixtures("local_processes")
def test_the_evaluators_stand_in_answers_as_the_shell_does(tmp_path):
    problem = problems("train")[3]
    task = multistep_tasks.task(problem, 0)
    wrong = next(n for n in NAMES if n != problem.folder)
    commands = [f"ls {ROOT}", f"ls {ROOT}/{problem.folder}", f"ls {ROOT}/{wrong}"]
    outputs, _ = _shell(task, commands, tmp_path / "shell")
    stand_in = StandIn(problem)
    for command, stdout in zip(commands, outputs, strict=True):
        assert problem.listing(command)[0] == stdout
    assert problem.listing(commands[2])[2] != 0
    stand_in.run(problem.actions()[2])
    assert stand_in.solved
    other = StandIn(problem)
    other.run(problem.compute(f"{ROOT}/{wrong}/{problem.file}"))
    assert not other.solved
