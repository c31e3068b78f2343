"""Task images built by podman's own builder from a task's Dockerfile, offline: FROM mapped onto
the local base, cached by the build context's hash, refused by name when a FROM is unknown."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from belayer.sandbox import runtime
from belayer.sandbox.images import (
    ImageBuilder,
    ImageBuildError,
    base_images_of,
    context_sha256,
    task_image_tag,
)

MULTI_STAGE = """\
FROM ubuntu:24.04 AS build
RUN echo compiled > /artifact.txt
FROM ubuntu:24.04
WORKDIR /app
ENV GREETING=hello \\
    TARGET=world
COPY input.txt /app/input.txt
COPY --from=build /artifact.txt /app/artifact.txt
RUN useradd -u 1234 -m runner && cat /app/input.txt /app/artifact.txt > /app/both.txt
USER runner
"""


def test_from_lines_name_images_not_stages():
    text = "FROM --platform=linux/amd64 python:3.12-slim AS base\nRUN true\nFROM base AS test\nFROM scratch\n" \
           "FROM \\\n  ubuntu:24.04\n"  # fmt: skip
    uses = base_images_of(text)
    assert [(u.image, u.line) for u in uses] == [("python:3.12-slim", 1), ("ubuntu:24.04", 5)]


def test_the_context_hash_covers_every_file_its_mode_and_the_dockerfile(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM ubuntu:24.04\n")
    first = context_sha256(tmp_path, dockerfile)
    (tmp_path / "a.txt").chmod(0o755)
    executable = context_sha256(tmp_path, dockerfile)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    nested = context_sha256(tmp_path, dockerfile)
    rebased = context_sha256(tmp_path, dockerfile, ["sha256:another-base"])  # the FROM image rebuilt
    assert len({first, executable, nested, rebased}) == 4
    assert context_sha256(tmp_path, dockerfile) == nested


@pytest.fixture
def task_id() -> str:
    """The test's own task id (the start of every task id it builds): its teardown removes
    only its own images (another xdist worker's test may be running a sandbox from one)."""
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def builder(sandbox_runtime, task_id):
    built = ImageBuilder({"ubuntu:24.04": runtime.base_image_name()})
    yield built
    listed = built.podman(
        "images",
        "--format",
        "{{.Repository}}:{{.Tag}}",
        "--filter",
        f"reference=localhost/belayer-task/{task_id}*",
    )
    for tag in listed.stdout.split():
        built.podman("rmi", "-f", tag)


def task_context(tmp_path: Path, dockerfile: str) -> tuple[Path, Path]:
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(dockerfile)
    (context / "input.txt").write_text("from the context\n")
    return context, context / "Dockerfile"


def in_image(builder: ImageBuilder, tag: str, script: str) -> str:
    ran = builder.podman("run", "--rm", "--network=none", tag, "sh", "-c", script)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


def test_a_multi_stage_dockerfile_builds_as_dockerfiles_mean_and_is_cached_by_its_context(
    builder, tmp_path, task_id
):
    context, dockerfile = task_context(tmp_path, MULTI_STAGE)
    steps: list[str] = []
    image = builder.build(task_id, context, dockerfile, progress=steps.append)
    assert not image.cached and image.tag.startswith(f"localhost/belayer-task/{task_id}:")
    assert any("STEP 1/" in line for line in steps), steps
    seen = in_image(
        builder,
        image.tag,
        'cat /app/both.txt; echo "$GREETING $TARGET"; pwd; id -u; . /etc/os-release; echo $ID',
    )
    assert seen.split("\n")[:-1] == ["from the context", "compiled", "hello world", "/app", "1234", "debian"]

    again = builder.build(task_id, context, dockerfile)
    assert again.cached and (again.tag, again.image_id) == (image.tag, image.image_id)
    (context / "input.txt").write_text("changed\n")
    changed = builder.build(task_id, context, dockerfile)
    assert not changed.cached and changed.tag != image.tag
    assert in_image(builder, changed.tag, "cat /app/input.txt") == "changed\n"


def test_an_unmapped_from_is_refused_before_any_build(builder, tmp_path, task_id):
    context, dockerfile = task_context(tmp_path, "FROM ubuntu:24.04\nFROM registry.example/tool:1 AS t\n")
    with pytest.raises(ImageBuildError) as refused:
        builder.build(task_id, context, dockerfile)
    message = str(refused.value)
    assert f"{dockerfile}:2: FROM registry.example/tool:1 is not in Belayer's podman storage" in message
    assert "sandbox.base_images" in message and "BELAYER_SANDBOX__BASE_IMAGES" in message
    assert builder.image_id(f"localhost/belayer-task/{task_id}") is None


def test_a_failing_run_line_fails_the_build_with_its_output(builder, tmp_path, task_id):
    context, dockerfile = task_context(tmp_path, "FROM ubuntu:24.04\nRUN echo about-to-fail && false\n")
    with pytest.raises(ImageBuildError, match=r"podman build failed \(exit \d+\):[\s\S]*about-to-fail"):
        builder.build(task_id, context, dockerfile)


def test_a_build_past_its_timeout_is_killed_and_named_and_leaves_nothing(builder, tmp_path, task_id):
    """The limit holds while a RUN line prints nothing (the output is read until the end);
    the killed build's RUN processes and its working container do not outlive it."""
    marker = uuid.uuid4().hex
    context, dockerfile = task_context(tmp_path, f"FROM ubuntu:24.04\nRUN sleep 120 # {marker}\n")
    before = working_containers(builder) | build_cgroups()
    with pytest.raises(ImageBuildError, match=r"ran past 3 s \(\[environment\].build_timeout_sec\)"):
        builder.build(task_id, context, dockerfile, timeout_s=3)
    assert builder.image_id(task_image_tag(task_id, context_sha256(context, dockerfile))) is None
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1, (
        "the RUN step lives on"
    )
    # another build running beside this test has its own working container until it ends
    for _ in range(30):
        if not (left := (working_containers(builder) | build_cgroups()) - before):
            break
        time.sleep(1)
    assert not left, f"the killed build's working container or cgroups are left: {left}"


def build_cgroups() -> set[str]:
    """The cgroups of buildah's RUN steps (`buildah-<bundle>`), every controller's."""
    return {str(path) for path in Path("/sys/fs/cgroup").glob("*buildah-*")} | {
        str(path) for path in Path("/sys/fs/cgroup").glob("*/buildah-*")
    }


def working_containers(builder) -> set[str]:
    """Buildah's working containers in Belayer's storage (podman lists them as external)."""
    listed = builder.podman("ps", "-a", "--external", "--format", "{{.ID}} {{.Status}}").stdout.split("\n")
    return {line.split()[0] for line in listed if line.strip().endswith("Storage")}


def test_tasks_check_builds_a_datasets_images_and_lists_each_tasks_problem(builder, tmp_path, task_id):
    dataset = tmp_path / "dataset"
    for name, toml in (
        (f"{task_id}-good", "[environment]\nallow_internet = false\n"),
        (f"{task_id}-bad", "[agent]\ntimeout = 3\n"),
    ):
        task = dataset / name
        (task / "environment").mkdir(parents=True)
        (task / "tests").mkdir()
        (task / "task.toml").write_text(toml)
        (task / "instruction.md").write_text("do it\n")
        (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
        (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    command = [sys.executable, "-m", "belayer.cli", "tasks", "check", str(dataset), "--no-run", "--json"]
    checked = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert checked.returncode == 1, checked.stderr
    bad, good = json.loads(checked.stdout)["tasks"]
    assert (bad["task"], bad["ok"], bad["image"]) == (f"{task_id}-bad", False, None)
    assert "field agent.timeout: unknown field" in bad["problem"]
    assert good["ok"] and good["steps"] == 1 and good["image_built_s"] is not None
    assert builder.image_id(good["image"]) == good["image_id"]
    again = json.loads(subprocess.run(command, capture_output=True, text=True, timeout=300).stdout)["tasks"][
        1
    ]
    assert again["image"] == good["image"] and again["image_built_s"] is None  # found by its context hash
