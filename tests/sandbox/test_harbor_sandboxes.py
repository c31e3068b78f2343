"""A Harbor task's sandbox on the real stack: its image run as built (the agent root in its
WORKDIR, the image's environment, a writable root that checkpoints carry), its tests
installed by PID 1 at verify time, its reward read from what they wrote, and nothing the
agent planted beforehand (a reward file, a symbolic link) counted."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from belayer.sandbox import runtime
from belayer.sandbox.images import ImageBuilder
from belayer.sandbox.models import Action, ImageSemantics, SandboxSpec
from belayer.workloads.harbor_tasks import pack, store_files
from tests.sandbox.conftest import own_layers

DOCKERFILE = """\
FROM debian:bookworm
WORKDIR /app
RUN echo "print('hello from the image')" > /app/main.py
ENV TASK_FLAVOUR=harbor
"""
TEST_SH = """\
#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/answer 2>/dev/null)" = 42 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
echo "verifier ran as $(id -u) in $PWD with MODE=$MODE"
"""


@pytest.fixture
def harbor_image(sandbox_runtime, tmp_path):
    """Tests name it before `sandboxes`, so it is removed after their containers are: `rmi -f`
    of an image containers still run stops each with a 10 s grace."""
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(own_layers(DOCKERFILE))
    builder = ImageBuilder({"debian:bookworm": runtime.base_image_name()})
    image = builder.build(f"test-harbor-{uuid.uuid4().hex[:8]}", context, context / "Dockerfile")
    yield image.tag
    builder.podman("rmi", "-f", image.tag)


@pytest.fixture
def tests_files(sandboxes, tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text(TEST_SH)
    return store_files(sandboxes.host.store, pack([tests]))


def spec_for(sandboxes, image: str, **semantics) -> SandboxSpec:
    return SandboxSpec(labels={"belayer.test": sandboxes.token}, image=image,
                       semantics=ImageSemantics(workdir="/app", **semantics))  # fmt: skip


def act(host, handle, step: int, command: str, trajectory: str = "t-harbor"):
    return host.exec(handle, Action(trajectory=trajectory, step=step, command=command))


def test_the_agent_is_a_capless_root_in_the_images_workdir_and_the_root_it_writes_is_checkpointed(
    harbor_image, sandboxes
):
    host = sandboxes.host
    handle = host.create(spec_for(sandboxes, harbor_image, env={"EXTRA": "from-task"}))
    seen = act(host, handle, 1, "id -u; pwd; echo $TASK_FLAVOUR $EXTRA; python3 main.py; "
                                "echo installed > /usr/local/bin/tool-marker")  # fmt: skip
    assert seen.exit_code == 0, seen
    assert seen.stdout.splitlines() == ["0", "/app", "harbor from-task", "hello from the image"]
    # root, but no capability: not PID 1's environment, not the journal, not a signal to PID 1 that lands
    probe = act(host, handle, 2, "grep Cap[EP] /proc/self/status; cat /proc/1/environ >/dev/null 2>&1 && echo READ-ENV; "
                                 "ls /var/lib/belayer >/dev/null 2>&1 && echo READ-JOURNAL; true")  # fmt: skip
    assert "READ-ENV" not in probe.stdout and "READ-JOURNAL" not in probe.stdout, probe
    assert {line.split()[1] for line in probe.stdout.splitlines() if line.startswith("Cap")} == {
        "0000000000000000"
    }

    ref = host.checkpoint(handle)
    host.destroy(handle)
    restored, _ = host.restore(ref, handle.generation + 1)
    assert act(host, restored, 3, "cat /usr/local/bin/tool-marker; pwd").stdout == "installed\n/app\n"


def test_the_tests_land_at_verify_time_and_what_the_agent_planted_counts_for_nothing(
    harbor_image, sandboxes, tests_files
):
    host = sandboxes.host
    handle = host.create(spec_for(sandboxes, harbor_image))
    planted = act(host, handle, 1, "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                                   "ln -s /var/lib/belayer /logs/verifier/journal")  # fmt: skip
    assert planted.exit_code == 0, planted
    check = Action(trajectory="t-harbor", step=2, command="MODE=strict bash /tests/test.sh", timeout_s=30)
    graded = host.verify(handle, check, tests_files, processes="running")
    assert graded.files == {"reward.txt": b"0\n"}, (
        graded
    )  # the real tests ran; the planted link was never read
    assert "verifier ran as 0 in /app with MODE=strict" in graded.observation.stdout

    # a retried verify gets the journal's run and the same files: nothing reinstalled over them
    again = host.verify(handle, check, tests_files, processes="running")
    assert again.files == graded.files and again.observation.replayed_from_journal


def test_the_answer_scores_and_a_verifier_that_writes_nothing_or_hangs_is_seen_as_such(
    harbor_image, sandboxes, tests_files
):
    host = sandboxes.host
    handle = host.create(spec_for(sandboxes, harbor_image, uploads={"/solution": tests_files}))
    assert act(host, handle, 1, "ls /solution; echo 42 > answer").stdout == "test.sh\n"
    solved = host.verify(handle, Action(trajectory="t-harbor", step=2, command="bash /tests/test.sh"),
                         tests_files, processes="frozen")  # fmt: skip
    assert solved.files["reward.txt"] == b"1\n"

    other = host.create(spec_for(sandboxes, harbor_image))
    hung = host.verify(other, Action(trajectory="t-hang", step=1, command="sleep 30", timeout_s=1),
                       tests_files, processes="running")  # fmt: skip
    assert hung.observation.timed_out and hung.files == {}


def test_a_named_agent_user_acts_as_itself_and_the_tests_stay_the_verifiers(
    harbor_image, sandboxes, tests_files
):
    host = sandboxes.host
    handle = host.create(spec_for(sandboxes, harbor_image, agent_user="nobody"))
    seen = act(host, handle, 1, "id -un; touch /app/mine 2>/dev/null || echo read-only-app; echo $HOME")
    assert seen.stdout.splitlines() == ["nobody", "read-only-app", "/nonexistent"], (
        seen
    )  # Docker's USER semantics
    graded = host.verify(handle, Action(trajectory="t-harbor", step=2, command="id -un; bash /tests/test.sh"),
                         tests_files, processes="running")  # fmt: skip
    assert graded.observation.stdout.startswith("root\n") and graded.files == {"reward.txt": b"0\n"}


def test_a_named_verifier_user_runs_the_tests_and_the_storage_used_is_measured(
    harbor_image, sandboxes, tests_files
):
    host = sandboxes.host
    handle = host.create(spec_for(sandboxes, harbor_image, verifier_user="nobody"))
    wrote = act(host, handle, 1, "head -c 5000000 /dev/urandom > /app/blob && echo 42 > /app/answer")
    assert wrote.exit_code == 0, wrote
    graded = host.verify(handle, Action(trajectory="t-harbor", step=2, command="id -un; bash /tests/test.sh"),
                         tests_files, processes="running")  # fmt: skip
    assert graded.observation.stdout.startswith("nobody\n"), graded.observation
    assert "verifier ran as 65534" in graded.observation.stdout and graded.files == {"reward.txt": b"1\n"}
    # what the agent wrote over the image, as the engine counts it: the 5 MB blob and a little more
    assert 5_000_000 <= graded.disk_bytes < 20_000_000, graded.disk_bytes


def test_the_tasks_cpus_and_memory_are_the_kernels_limits(harbor_image, sandboxes):
    host = sandboxes.host
    handle = host.create(spec_for(sandboxes, harbor_image, memory_mb=96, cpus=0.5))
    # the container's cgroup, as the kernel keeps it
    assert cgroup_limits(host.backend.memory_cgroup(handle.container).parent) == (96 << 20, 50_000, 100_000)
    # and they bind: what the agent allocates past its memory is killed, not granted
    hog = act(host, handle, 1, "python3 -c 'b = bytearray(300 << 20); print(len(b))'; echo exit=$?")
    assert "exit=137" in hog.stdout, hog


def cgroup_limits(memory_dir: Path) -> tuple[int, int, int]:
    """(memory limit, CPU quota, CPU period) of a container's cgroup, v2 or v1."""
    if (memory_dir / "memory.max").exists():
        quota, period = (memory_dir / "cpu.max").read_text().split()
        return int((memory_dir / "memory.max").read_text()), int(quota), int(period)
    cpu_dir = Path("/sys/fs/cgroup/cpu") / memory_dir.relative_to("/sys/fs/cgroup/memory")
    files = (
        memory_dir / "memory.limit_in_bytes",
        cpu_dir / "cpu.cfs_quota_us",
        cpu_dir / "cpu.cfs_period_us",
    )
    memory, quota, period = (int(path.read_text()) for path in files)
    return memory, quota, period
