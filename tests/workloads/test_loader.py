"""Workload files: valid examples load, invalid ones name the task, the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer.workloads.loader import WorkloadError, load_workload
from belayer.workloads.models import HarborSource, ModelTask, TraceTask

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "workloads"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_shipped_example_loads():
    examples = sorted(EXAMPLES.glob("*.yaml")) + sorted(EXAMPLES.glob("*.jsonl"))
    assert examples, "no example workloads shipped"
    for path in examples:
        assert load_workload(path).tasks


def test_kinds_are_inferred_from_fields(tmp_path):
    path = write(
        tmp_path,
        "w.yaml",
        """
tasks:
  - id: replay-1
    turns: [{think_tokens: 4, bash: "echo hi"}]
  - id: agent-1
    instruction: "create hello.txt"
""",
    )
    trace, model = load_workload(path).tasks
    assert isinstance(trace, TraceTask) and isinstance(model, ModelTask)
    assert model.max_turns == 8


def test_a_training_workload_names_its_model_and_heldout_file(tmp_path):
    write(tmp_path, "held.yaml", "tasks: [{id: h, instruction: x}]\n")
    path = write(
        tmp_path, "w.yaml", "tasks: [{id: a, instruction: x}]\nmodel: tiny-warm\nheldout: held.yaml\n"
    )
    workload = load_workload(path)
    assert workload.model == "tiny-warm" and workload.lr is None
    assert [t.id for t in load_workload(workload.heldout).tasks] == ["h"]


def test_a_training_workload_names_the_learning_rate_it_was_tuned_with(tmp_path):
    path = write(tmp_path, "w.yaml", "tasks: [{id: a, instruction: x}]\nlr: 0.0002\n")
    assert load_workload(path).lr == 0.0002
    for bad in ("-1", "fast", "true"):
        path = write(tmp_path, "bad.yaml", f"tasks: [{{id: a, instruction: x}}]\nlr: {bad}\n")
        with pytest.raises(WorkloadError, match=r"`lr: .*` is not a learning rate; give a number >= 0"):
            load_workload(path)


def test_a_training_workload_names_the_group_size_and_kl_weight_it_was_tuned_with(tmp_path):
    path = write(tmp_path, "w.yaml", "tasks: [{id: a, instruction: x}]\ngroup_size: 8\nkl_coef: 0.1\n")
    workload = load_workload(path)
    assert (workload.group_size, workload.kl_coef) == (8, 0.1)
    for line, message in [
        (
            "group_size: 1",
            r"`group_size: 1` is not a group size; give a whole number from 2 to 256 \(say 8\)",
        ),
        ("group_size: 1000", r"`group_size: 1000` is not a group size; give a whole number from 2 to 256"),
        ("group_size: 2.5", r"`group_size: 2.5` is not a group size"),
        ("kl_coef: -0.1", r"`kl_coef: -0.1` is not a KL penalty's weight; give a number >= 0"),
    ]:
        path = write(tmp_path, "bad.yaml", f"tasks: [{{id: a, instruction: x}}]\n{line}\n")
        with pytest.raises(WorkloadError, match=message):
            load_workload(path)


def test_jsonl(tmp_path):
    path = write(
        tmp_path,
        "w.jsonl",
        '{"id": "a", "turns": [{"think_tokens": 1, "bash": "true"}]}\n\n{"id": "b", "instruction": "x"}\n',
    )
    assert [t.id for t in load_workload(path).tasks] == ["a", "b"]


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "tasks:\n  - id: t1\n    turns: [{think_tokens: 4, bash: ls}]\n    colour: red\n",
            ["task 't1'", "field colour", "unknown field"],
        ),
        (
            "tasks:\n  - id: t2\n    turns: [{think_tokens: -1, bash: ls}]\n",
            ["task 't2'", "field turns.0.think_tokens", "greater than or equal to 0"],
        ),
        ("tasks:\n  - id: t3\n    turns: []\n", ["task 't3'", "field turns"]),
        ("tasks: []\n", ["no tasks"]),
        ("", ["no tasks"]),
        ("tasks:\n  - id: 'bad id!'\n    instruction: x\n", ["field id", "letters, digits"]),
        ("tasks:\n  - {id: a, instruction: x}\n  - {id: a, instruction: y}\n", ["appears twice"]),
        ("tasks: [\n", ["not valid YAML"]),
        ("jobs: []\n", ["mapping with `tasks:`"]),
        ("tasks: [{id: a, instruction: x}]\nmodel: gpt\n", ["`model: gpt`", "tiny-warm"]),
        (
            "tasks: [{id: a, instruction: x}]\nheldout: nowhere.yaml\n",
            ["`heldout: nowhere.yaml` names no workload file or Harbor dataset"],
        ),
    ],
)
def test_invalid_files_name_task_field_and_fix(tmp_path, text, expected):
    with pytest.raises(WorkloadError) as excinfo:
        load_workload(write(tmp_path, "w.yaml", text))
    for fragment in expected:
        assert fragment in str(excinfo.value)


def test_an_unknown_kind_is_named_with_the_kinds_there_are(tmp_path):
    path = write(tmp_path, "w.yaml", "tasks:\n  - {id: s1, kind: swe, instruction: x}\n")
    with pytest.raises(
        WorkloadError,
        match=r"task 's1' is invalid:\n  field kind: unknown task kind 'swe': "
        r"use one of trace, model, harbor",
    ):
        load_workload(path)


def test_a_harbor_task_is_listed_by_its_directory_never_written_in_a_workload(tmp_path):
    path = write(tmp_path, "w.yaml", "tasks:\n  - {id: h1, kind: harbor, instruction: x}\n")
    with pytest.raises(WorkloadError, match="list the directories or datasets under `harbor:`"):
        load_workload(path)


def test_a_workload_lists_harbor_paths_beside_its_tasks_relative_to_itself(tmp_path):
    task = tmp_path / "harbor" / "fix-it"
    (task / "tests").mkdir(parents=True)
    (task / "task.toml").write_text("")
    path = write(
        tmp_path, "w.yaml", "harbor: [harbor, {path: harbor/fix-it, freeze_agent: true}]\nheldout: harbor\n"
    )
    loaded = load_workload(path)
    assert (loaded.tasks, loaded.heldout) == ([], tmp_path / "harbor")
    assert loaded.harbor == [HarborSource(path=tmp_path / "harbor"),
                             HarborSource(path=tmp_path / "harbor" / "fix-it", freeze_agent=True)]  # fmt: skip
    with pytest.raises(WorkloadError, match=r"`harbor: elsewhere` is no Harbor task directory or dataset"):
        load_workload(write(tmp_path, "x.yaml", "harbor: [elsewhere]\n"))
    with pytest.raises(
        WorkloadError, match=r"field freeze: Extra inputs are not permitted; `harbor:` must be"
    ):
        load_workload(write(tmp_path, "y.yaml", "harbor: [{path: harbor, freeze: true}]\n"))
    with pytest.raises(WorkloadError, match=r"each a path or `\{path: PATH, freeze_agent: true\}`; got 3"):
        load_workload(write(tmp_path, "z.yaml", "harbor: [3]\n"))


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "nope.yaml")
    with pytest.raises(WorkloadError, match="unknown workload format"):
        load_workload(write(tmp_path, "w.txt", "tasks: []"))
    with pytest.raises(WorkloadError, match=r"w.jsonl:1: not valid JSON"):
        load_workload(write(tmp_path, "w.jsonl", "{oops\n"))
