"""`belayer tasks check`'s agents on a multi-step Harbor task in a real sandbox: the steps run
in order in one sandbox (each step's workdir/ files and setup.sh before its agent; the
second's starts a server its healthcheck waits for and its tests query), the
task's reward is the mean of its steps' (a step not run counts 0), and a step below its
`min_reward` stops the task there."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from belayer.sandbox import runtime
from belayer.sandbox.images import ImageBuilder
from belayer.workloads.harbor import load_task
from belayer.workloads.harbor_check import check_agent
from belayer.workloads.harbor_tasks import task_image
from tests.sandbox.conftest import own_layers

TASK_TOML = """\
version = "1.0"
[environment]
allow_internet = false
[[steps]]
name = "first"
min_reward = 1.0
[[steps]]
name = "second"
artifacts = ["two", "/app/given.txt"]
[steps.healthcheck]
command = "python3 -c 'import urllib.request; urllib.request.urlopen(\\"http://127.0.0.1:8123/given.txt\\")'"
interval_sec = 0.2
timeout_sec = 5
retries = 25
"""
# The second step's setup starts a server its healthcheck waits for and its tests query.
SERVE = "nohup python3 -m http.server 8123 --bind 127.0.0.1 --directory /app >/dev/null 2>&1 &\n"
FETCH_TWO = "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8123/two\").read().decode())'"


def write_task(root: Path) -> Path:
    task = root / f"two-steps-{uuid.uuid4().hex[:6]}"
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(own_layers("FROM debian:bookworm\nWORKDIR /app\n"))
    (task / "task.toml").write_text(TASK_TOML)
    first, second = task / "steps" / "first", task / "steps" / "second"
    for step in (first, second):
        (step / "tests").mkdir(parents=True)
        (step / "solution").mkdir()
        (step / "instruction.md").write_text(f"Do {step.name}.\n")
    (first / "tests" / "test.sh").write_text(
        "mkdir -p /logs/verifier; [ -f /app/one ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    )
    (first / "solution" / "solve.sh").write_text("touch /app/one\n")
    # the second step: its workdir/ files and setup.sh arrive before its agent acts; half marks
    (second / "workdir").mkdir()
    (second / "workdir" / "given.txt").write_text("given\n")
    (second / "setup.sh").write_text("echo set-up > /app/setup-ran\n" + SERVE)
    (second / "tests" / "test.sh").write_text(
        "mkdir -p /logs/verifier\n"
        f"served=$({FETCH_TWO})\n"
        'ok=0; [ "$(cat /app/given.txt /app/setup-ran 2>/dev/null; echo $served)" = "$(printf \'given\\nset-up\\ntwo\')" ] && ok=1\n'
        'echo "{\\"reward\\": $ok, \\"half\\": 0.5}" > /logs/verifier/reward.json\n'
    )
    (second / "solution" / "solve.sh").write_text("echo two > /app/two\n")
    return task


@pytest.fixture
def two_step_task(sandboxes, tmp_path):
    builder = ImageBuilder({"debian:bookworm": runtime.base_image_name()})
    task = load_task(write_task(tmp_path))
    image = task_image(builder, task)
    yield task, image, builder
    builder.podman("rmi", "-f", image)


def test_the_oracle_runs_both_steps_and_nop_stops_below_min_reward(sandboxes, two_step_task):
    task, image, builder = two_step_task
    oracle = check_agent(sandboxes.host, task, image, "oracle", builder)
    assert (oracle.step_rewards, oracle.reward, oracle.problem) == ([1.0, 1.0], 1.0, None), oracle
    nop = check_agent(sandboxes.host, task, image, "nop", builder)
    # the first step scored 0 < min_reward 1: the second never ran and counts 0
    assert (nop.step_rewards, nop.reward) == ([0.0], 0.0), nop


def test_a_healthcheck_that_never_passes_stops_the_task_before_its_step(sandboxes, tmp_path):
    path = write_task(tmp_path)
    (path / "steps" / "second" / "setup.sh").write_text("echo set-up > /app/setup-ran\n")  # no server
    (path / "task.toml").write_text(TASK_TOML.replace("retries = 25", "retries = 2"))
    builder = ImageBuilder({"debian:bookworm": runtime.base_image_name()})
    task = load_task(path)
    image = task_image(builder, task)
    try:
        oracle = check_agent(sandboxes.host, task, image, "oracle", builder)
    finally:
        builder.podman("rmi", "-f", image)
    assert oracle.step_rewards == [1.0] and "healthcheck failed 2 times" in oracle.problem, oracle
