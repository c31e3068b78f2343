"""Sandboxes of a task's own image: created, checkpointed, restored and forked like any other,
and a host that lacks the image loads it from the object store by id, never rebuilds it."""

from __future__ import annotations

import uuid

import pytest

from belayer.sandbox import runtime
from belayer.sandbox.images import IMAGES_PREFIX, ImageBuilder, ImageUnavailable
from belayer.sandbox.models import Action, ForkTarget, SandboxSpec
from tests.sandbox.conftest import own_layers

DOCKERFILE = """\
FROM ubuntu:24.04
RUN mkdir -p /opt/task && echo "from the task image" > /opt/task/marker
ENV TASK_LEVEL=hard
"""


@pytest.fixture
def task_image(sandbox_runtime, tmp_path):
    """Tests name it before `sandboxes`, so it is removed after their containers are: `rmi -f`
    of an image containers still run stops each with a 10 s grace."""
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(own_layers(DOCKERFILE))
    builder = ImageBuilder({"ubuntu:24.04": runtime.base_image_name()})
    image = builder.build(f"test-img-{uuid.uuid4().hex[:8]}", context, context / "Dockerfile")
    yield image
    builder.podman("rmi", "-f", image.tag)


def run(sandboxes, handle, step: int, command: str):
    return sandboxes.host.exec(handle, Action(trajectory="t-image", step=step, command=command))


def test_a_task_image_sandbox_is_checkpointed_and_restored_on_a_host_that_lacks_the_image(
    task_image, sandboxes
):
    host, backend = sandboxes.host, sandboxes.backend
    spec = SandboxSpec(labels={"belayer.test": sandboxes.token}, image=task_image.tag)
    handle = host.create(spec)
    first = run(sandboxes, handle, 1, "cat /opt/task/marker; echo state > /workspace/s; echo $TASK_LEVEL")
    assert first.exit_code == 0 and first.stdout.split("\n")[:1] == ["from the task image"], first
    stored = [key for key in host.store.list(IMAGES_PREFIX) if key.endswith("/image.tar")]
    assert any(task_image.image_id.removeprefix("sha256:") in key for key in stored), stored

    ref = host.checkpoint(handle)
    meta = host.load_meta(ref)
    assert (meta.image, meta.image_id) == (task_image.tag, task_image.image_id)
    host.destroy(handle)
    backend.podman("rmi", "-f", task_image.tag)  # this host no longer has it, as a second host would not
    assert backend.image_id(task_image.tag) == ""

    restored, _ = host.restore(ref, handle.generation + 1)
    assert backend.image_id(task_image.tag) == task_image.image_id  # loaded from the store, the same image
    again = run(sandboxes, restored, 2, "cat /opt/task/marker /workspace/s")
    assert again.stdout == "from the task image\nstate\n", again

    forks = host.fork(ref, [ForkTarget(sandbox_id=f"sbx-{uuid.uuid4().hex[:12]}", trajectory="t-fork")])
    (fork,) = forks
    assert fork.handle is not None, fork.error
    seen = host.exec(fork.handle, Action(trajectory="t-fork", step=2, command="cat /opt/task/marker"))
    assert seen.stdout == "from the task image\n"
    # a checkpoint of the fork names the task image too: it restores anywhere the same way
    assert host.load_meta(host.checkpoint(fork.handle)).image == task_image.tag


def test_an_image_no_host_built_is_refused_by_name_and_nothing_is_left(sandboxes):
    missing = f"localhost/belayer-task/never-built-{uuid.uuid4().hex[:8]}:0"
    with pytest.raises(ImageUnavailable, match="neither on this host nor in the object store"):
        sandboxes.host.create(SandboxSpec(labels={"belayer.test": sandboxes.token}, image=missing))
    assert not sandboxes.backend.podman(
        "ps", "-a", "--filter", f"label=belayer.test={sandboxes.token}", "--format", "{{.Names}}"
    ).stdout.strip()
