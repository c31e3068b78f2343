"""Hostile workload files: each is refused with a `WorkloadError` (one clear line from the
CLI, nothing started), never a traceback, a hang or code execution.

Plainly invalid fields are tested in tests/workloads/test_loader.py and
tests/test_cli_errors.py; these are the files someone crafts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer.workloads.loader import WorkloadError, load_workload


def billion_laughs() -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return (
        "\n".join(lines)
        + "\ntasks:\n  - id: bomb\n    setup: *a9\n    turns: [{think_tokens: 1, bash: ls}]\n"
    )


CASES = {
    "billion-laughs.yaml": billion_laughs(),
    "python-tag.yaml": "tasks: !!python/object/apply:os.system ['touch /tmp/belayer-pwned']\n",
    "nul-byte.yaml": 'tasks:\n  - id: "a\0b"\n    turns: [{think_tokens: 1, bash: ls}]\n',
    "huge-number.yaml": "tasks:\n  - id: h\n    turns: [{think_tokens: 99999999999999999999999, bash: ls}]\n",
    "scalar.yaml": "just a string\n",
    "task-is-list.yaml": "tasks: [[1, 2], 3]\n",
    "id-injection.yaml": "tasks:\n  - id: 'x; rm -rf /'\n    turns: [{think_tokens: 1, bash: ls}]\n",
    "dup-keys.jsonl": '{"id": "a", "id": "b", "turns": "x"}\n',
    "json-array.jsonl": "[1, 2, 3]\n",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_crafted_workload_is_refused(tmp_path: Path, name: str):
    path = tmp_path / name
    path.write_text(CASES[name])
    with pytest.raises(WorkloadError) as err:
        load_workload(path)
    assert str(err.value).startswith(str(path)), err.value
    assert not Path("/tmp/belayer-pwned").exists()


RAW_CASES = {
    # invalid UTF-8 / binary: must be refused with one clear line, not a UnicodeDecodeError traceback
    "bad-utf8.yaml": b'tasks:\n  - id: x\n    turns: [{think_tokens: 1, bash: "\xff\xfe"}]\n',
    "binary.jsonl": bytes(range(256)) * 4,
    # deep nesting: must be refused with one clear line, not a RecursionError traceback
    "deep.jsonl": b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "deep.yaml": b"tasks: " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
}


@pytest.mark.parametrize("name", sorted(RAW_CASES))
def test_undecodable_or_deeply_nested_workload_is_refused(tmp_path: Path, name: str):
    path = tmp_path / name
    path.write_bytes(RAW_CASES[name])
    with pytest.raises(WorkloadError):
        load_workload(path)
