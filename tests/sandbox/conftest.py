"""Fixtures for real sandboxes: podman + runc + CRIU on this host, checkpoints in SeaweedFS.

Every sandbox a test creates is tagged (label `belayer.test=<token>`) and recorded by a
tracking backend; teardown destroys each one (containers of every generation, channel
directory) even when the test failed, then checks that nothing is
left and names what leaked. Checkpoint objects live under the test's own key prefix,
which the `storage_config` fixture deletes afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from belayer.sandbox import runtime
from belayer.sandbox.config import SandboxConfig
from belayer.sandbox.host import SandboxHost
from belayer.sandbox.models import SandboxSpec
from belayer.sandbox.podman import LABEL_SANDBOX, PodmanBackend
from tests.tiers import needs

REPO = Path(__file__).resolve().parents[2]
TEST_LABEL = "belayer.test"


OWNER_LABEL = "belayer.test.owner"  # pid of the test process that created the container


class TrackingBackend(PodmanBackend):
    """Records every sandbox lineage it touches, so teardown can remove it; labels every
    container with its test process's pid, so a later session can sweep what a killed
    session (SIGKILL/SIGTERM: no teardown) left behind."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[str] = set()

    def create(self, sandbox_id, generation, labels, image=None, semantics=None):
        self.seen.add(sandbox_id)
        labels = {**labels, OWNER_LABEL: str(os.getpid())}
        return super().create(sandbox_id, generation, labels, image=image, semantics=semantics)

    def restore(self, archive, sandbox_id, generation):
        self.seen.add(sandbox_id)
        return super().restore(archive, sandbox_id, generation)

    def fork(self, plain_archive, parent_id, sandbox_id, generation):
        self.seen.add(sandbox_id)
        return super().fork(plain_archive, parent_id, sandbox_id, generation)


def sweep_orphans(backend: PodmanBackend) -> list[str]:
    """Destroy test sandboxes whose creating test process is gone; returns their ids."""
    r = backend.podman("ps", "-a", "--filter", f"label={OWNER_LABEL}", "--format",
                       f'{{{{index .Labels "{LABEL_SANDBOX}"}}}} {{{{index .Labels "{OWNER_LABEL}"}}}}',
                       check=False)  # fmt: skip
    swept = []
    for line in r.stdout.decode().splitlines():
        sid, _, pid = line.partition(" ")
        if sid and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            backend.destroy(sid)
            swept.append(sid)
    return swept


@pytest.fixture(scope="session")
@needs("sandbox")
def sandbox_runtime():
    """The runtime is healthy, the base image and the trusted toolchain carry the current
    infra/sandbox/."""
    # Idempotent and fast when they already carry this supervisor (cache keys).
    runs = [subprocess.run(["bash", str(REPO / f"infra/install/{script}.sh")], capture_output=True, text=True)
            for script in ("base-image", "toolchain")]  # fmt: skip
    output = "".join(f"\n{r.args[1]}:\n{r.stdout}{r.stderr}" for r in runs)
    health = runtime.check_runtime()
    if not health.ok:
        pytest.skip("sandbox runtime unavailable: " + "; ".join(health.problems) + output)
    assert all(r.returncode == 0 for r in runs), f"an install step failed:{output}"
    swept = sweep_orphans(PodmanBackend(small_config(), runtime.default_state_dir()))
    if swept:
        print(f"swept sandboxes left by killed test sessions: {swept}")
    return health


def small_config(**overrides) -> SandboxConfig:
    """Limits small enough that two cores run the suite; tests override what they probe."""
    values = dict(memory_mb=512, workspace_mb=64, home_mb=32, tmp_mb=32, pids_limit=128,
                  action_timeout_s=30.0, output_cap_bytes=16 * 1024, image=runtime.base_image_name())  # fmt: skip
    values.update(overrides)
    return SandboxConfig(**values)


class Sandboxes:
    """A SandboxHost plus the bookkeeping that guarantees cleanup."""

    def __init__(self, host: SandboxHost, backend: TrackingBackend, token: str):
        self.host = host
        self.backend = backend
        self.token = token

    def spec(self, *setup: str) -> SandboxSpec:
        return SandboxSpec(setup_commands=list(setup), labels={TEST_LABEL: self.token})

    def create(self, *setup: str):
        return self.host.create(self.spec(*setup))

    def cleanup(self) -> list[str]:
        ids = set(self.backend.seen)
        r = self.backend.podman("ps", "-a", "--filter", f"label={TEST_LABEL}={self.token}",
                                "--format", f'{{{{index .Labels "{LABEL_SANDBOX}"}}}}', check=False)  # fmt: skip
        ids.update(r.stdout.decode().split())
        for sid in ids:
            self.backend.destroy(sid)
        shutil.rmtree(self.host.owners.dir, ignore_errors=True)
        self.host.staging.drop_cache()
        shutil.rmtree(self.host.staging.staged_dir, ignore_errors=True)
        leaked = []
        r = self.backend.podman("ps", "-a", "--filter", f"label={TEST_LABEL}={self.token}",
                                "--format", "{{.Names}}", check=False)  # fmt: skip
        leaked += [f"container {n}" for n in r.stdout.decode().split()]
        for sid in ids:
            if self.backend.channel_dir(sid).exists():
                leaked.append(f"channel dir {self.backend.channel_dir(sid)}")
        return leaked


def make_sandboxes(storage_config, **config_overrides) -> Sandboxes:
    from belayer.storage.store import open_store

    cfg = small_config(**config_overrides)
    token = uuid.uuid4().hex[:12]
    state_dir = runtime.default_state_dir()
    backend = TrackingBackend(cfg, state_dir)
    host = SandboxHost(
        cfg,
        backend,
        open_store(storage_config, encrypted=False),
        state_dir=state_dir,
        # A queue of its own: the owner records the reaper reads are per host queue, and
        # another worker's test session (another Temporal) must never judge these sandboxes.
        host_queue=f"belayer-sandbox-test-{token}",
    )
    return Sandboxes(host, backend, token)


@pytest.fixture
def sandboxes(sandbox_runtime, storage_config, request):
    """Real sandboxes for one test; `@pytest.mark.sandbox_config(...)` overrides limits."""
    marker = request.node.get_closest_marker("sandbox_config")
    boxes = make_sandboxes(storage_config, **(marker.kwargs if marker else {}))
    try:
        yield boxes
    finally:
        leaked = boxes.cleanup()
        boxes.host.store.close()
    assert not leaked, f"test leaked: {leaked}"


def pytest_configure(config):
    config.addinivalue_line("markers", "sandbox_config(**limits): SandboxConfig overrides for `sandboxes`")


def own_layers(dockerfile: str) -> str:
    """`dockerfile` with a label of its own right after its FROM line, so that none of its
    build steps is shared through podman's layer cache with another test's build: a test
    removing its image (`rmi`) takes dangling intermediate images with it, which a build
    running beside it may have just found in the cache."""
    first, rest = dockerfile.split("\n", 1)
    return f"{first}\nLABEL test.run={uuid.uuid4().hex}\n{rest}"
