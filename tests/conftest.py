"""Shared fixtures: real local services on private ports and state directories.

Tests never use the developer's own `belayer up` stack: each session starts its own
SeaweedFS (and Temporal where needed) under a temporary state directory, on free
loopback ports, and stops exactly those processes at the end, even on failure, and
even when the run itself is terminated (`pytest_configure`).
"""

from __future__ import annotations

import os
import random
import signal
import uuid
import warnings
from pathlib import Path

import pytest

from belayer.config import BelayerConfig, load_config
from belayer.model.build import model_path
from belayer.rollout import shm
from belayer.stack import sandbox_hosts
from belayer.stack.local import LocalStack
from belayer.stack.process import ManagedProcess
from belayer.stack.services import SeaweedFS, TemporalDevServer, port_in_use
from belayer.storage.config import StorageConfig
from belayer.storage.s3client import make_s3_client
from tests import parallel
from tests.tiers import TIERS, ProcessGuard, needs, resources_of


def pytest_configure(config) -> None:
    """A run ended by SIGTERM (`timeout`, a CI job's limit) stops what it started too.

    By default SIGTERM kills pytest outright, and the session's servers, sandboxes and
    engines, started in sessions of their own, live on as orphans. As a
    KeyboardInterrupt, pytest reports the run interrupted and still tears down every
    fixture (the same path as Ctrl-C).

    A parallel run's controller waits for its workers to tear down (tests/parallel.py).
    """
    if parallel.is_controller(config):
        parallel.configure_controller()
    else:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    for tier, meaning in zip(TIERS, _TIER_MEANINGS, strict=True):
        config.addinivalue_line("markers", f"{tier}: {meaning} (assigned from fixtures: tests/tiers.py)")


def pytest_unconfigure(config) -> None:
    if parallel.is_controller(config):
        parallel.unconfigure_controller()


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` hands out the work units of tests/parallel.py."""
    return parallel.UnitScheduling(config, log) if config.option.dist == "loadgroup" else None


_TIER_MEANINGS = ("no process", "processes of its own: Temporal, SeaweedFS, the CLI", "vLLM engines",
                  "podman + CRIU sandboxes", "the whole stack or a benchmark run")  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    """Mark every test with the resources its fixtures declare (`pure` when none); a tier
    marker written by hand is refused, since it could disagree with what the test runs."""
    for item in items:
        written = sorted({m.name for m in item.iter_markers()} & set(TIERS))
        if written:
            raise pytest.UsageError(
                f"{item.nodeid}: tier markers {written} are assigned from fixtures, not written by hand; "
                "use the fixture that starts what the test needs (tests/tiers.py)"
            )
        resources = declared_resources(item)
        for tier in sorted(resources) or ["pure"]:
            item.add_marker(tier)
    items.sort(key=_whole_stack_turn)
    if parallel.is_worker(config):
        parallel.order_and_record_units(items)


def _whole_stack_turn(item) -> int:
    """Where a test runs in the session: the tests of the shared whole stack last, so it is
    up only for them; first those on two sandbox hosts, whose rollout nodes must all serve
    the built model (a training run leaves its node serving what it trained, and remembers
    it across restarts), then those on one. The sort is stable: the order within each
    group stays."""
    if TWO_HOST_STACK in item.fixturenames:
        return 1
    return 2 if ONE_HOST_STACK in item.fixturenames else 0


def declared_resources(item) -> frozenset[str]:
    """The resources declared by the fixtures `item` uses (the definition that applies to it)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return frozenset()
    return resources_of(defs[-1].func for name, defs in info.name2fixturedefs.items()
                        if defs and name in item.fixturenames)  # fmt: skip


@pytest.fixture(autouse=True)
def _process_guard(request):
    """Fail a test that starts a process its tier does not declare (tests/tiers.py)."""
    guard = ProcessGuard(request.node.nodeid, declared_resources(request.node))
    guard.install()
    try:
        yield
    finally:
        guard.uninstall()


@pytest.fixture
@needs("stack")
def local_processes() -> None:
    """Declares a test that starts processes of its own (the CLI, a service) outside the
    service fixtures: it belongs to the `stack` tier."""


@pytest.fixture(scope="session")
@needs("engine")
def tiny_model() -> Path:
    """The tiny model the project builds (vLLM serves it): declares the `engine` tier."""
    pytest.importorskip("vllm")
    _sweep_orphans_of_killed_sessions()
    return model_path("tiny")


def _sweep_orphans_of_killed_sessions() -> None:
    """A test session killed hard (SIGKILL, CI timeout) cannot unlink its nodes' segments:
    the next session removes the test nodes' segments that no process maps any more."""
    for path in shm.orphan_segments(prefix="belayer-t"):
        path.unlink(missing_ok=True)
        warnings.warn(f"removed shared memory left by a killed test session: {path}", stacklevel=1)


@pytest.fixture
@needs("whole")
def whole_system() -> None:
    """Declares a test that starts the whole stack (`belayer up`) or a benchmark run."""


ONE_HOST_STACK, TWO_HOST_STACK = "one_host_stack", "two_host_stack"
WHOLE_STACK_MODEL = "tiny-warm"  # the training tests need a model with something to learn
ROOM_PER_HOST = 2  # sandboxes per host on the two-host stack (`sandbox.max_sandboxes`)


@pytest.fixture(scope="session")
@needs("whole")
def shared_whole_stack():
    """One whole private stack (`belayer up`: Temporal, SeaweedFS, a podman sandbox host, a
    vLLM rollout node on the warm-started tiny model, the torch trainer), yielding
    (config, env), for every test that needs one (through `one_host_stack` or
    `two_host_stack`): a start and its teardown cost a minute on two cores. Its tests run
    last (`_whole_stack_turn`); a test that takes a component down brings it back with
    `belayer up`. At the end, `down`, and whatever is left running (a second host's
    processes too) is named as a leak."""
    from tests.test_stack import whole_stack  # imports this module (isolated_config)

    node_id = f"t{uuid.uuid4().hex[:6]}"
    with whole_stack(
        "blw-",
        {"BELAYER_ROLLOUT__MODEL": WHOLE_STACK_MODEL, "BELAYER_ROLLOUT__NODE_ID": node_id},
        also_leaked=lambda config: [p.pid for p in sandbox_hosts.processes(config, 1)],
    ) as started:
        yield started


@pytest.fixture(scope="session")
@needs("whole")
def two_host_stack(shared_whole_stack):
    """The shared stack grown to two sandbox hosts and two rollout nodes, each host with room
    for `ROOM_PER_HOST` sandboxes, and checkpoints at every step; yields (config, env), the
    env carrying those settings for the `belayer` commands that start or run anything. The
    first host is restarted for its new room; a stack does not shrink back, so these
    tests run before those of `one_host_stack`, which takes it down and up again."""
    from tests.test_stack import belayer  # imports this module (isolated_config)

    config, env = shared_whole_stack
    env = env | {"BELAYER_POLICY__MODE": "every-step", "BELAYER_SANDBOX__MAX_SANDBOXES": str(ROOM_PER_HOST)}
    ManagedProcess("sandbox-worker", config.state_dir).stop()
    belayer(env, "up", "--sandbox-hosts", "2", "--rollout-nodes", "2")
    return config, env


@pytest.fixture(scope="session")
@needs("whole")
def one_host_stack(shared_whole_stack):
    """The shared stack with one sandbox host and one rollout node, every component running:
    after the two-host tests, `belayer down` (which forgets the topology) and `up` again."""
    from tests.test_stack import belayer  # imports this module (isolated_config)

    config, env = shared_whole_stack
    grown = LocalStack(config)
    if (grown.sandbox_hosts, grown.rollout_nodes) != (1, 1):
        belayer(env, "down")
    belayer(env, "up")
    return config, env


def free_port_block(count: int, *, with_grpc: bool) -> list[int]:
    """`count` free loopback ports (and each +10000 for SeaweedFS' gRPC when asked), all
    below the kernel's ephemeral range (32768 on): a port free now but in that range can be
    handed to another service's outgoing or internal socket (Temporal's dev server opens
    some) before ours binds it."""
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(12000, 22000, 10)
        ports = [base + i for i in range(count)]
        needed = ports + ([p + 10000 for p in ports] if with_grpc else [])
        if not any(port_in_use("127.0.0.1", p) for p in needed):
            return ports
    raise RuntimeError("no free block of loopback ports for the test services")


def isolated_config(state_dir: Path) -> BelayerConfig:
    """A configuration whose every service lives in `state_dir` on free ports."""
    s3, master, volume, filer, admin, temporal, ui, serve = free_port_block(8, with_grpc=True)
    return load_config(
        state_dir=state_dir,
        temporal={"address": f"127.0.0.1:{temporal}", "ui_port": ui},
        storage={
            "endpoint": f"http://127.0.0.1:{s3}",
            "bucket": "belayer-test",
            "access_key": "test-access",
            "secret_key": "test-secret-" + uuid.uuid4().hex[:8],
        },
        stack={
            "seaweedfs_master_port": master,
            "seaweedfs_volume_port": volume,
            "seaweedfs_filer_port": filer,
            "seaweedfs_admin_port": admin,
            "serve_port": serve,
        },
    )


class ServiceHandle:
    """One real service of the test session that a test may kill and start again."""

    def __init__(self, stack: LocalStack, service):
        self.stack = stack
        self.service = service
        self.process: ManagedProcess = stack.process(service)

    def start(self) -> None:
        """Start (again, on the same data) and wait until it answers."""
        self.stack._start_one(self.service, lambda _m: None, wait=True)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data directory stays."""
        proc = self.process.running()
        if proc is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        self.process.stop()


class SeaweedFSHandle(ServiceHandle):
    @property
    def storage_config(self) -> StorageConfig:
        return self.stack.config.storage

    @property
    def endpoint(self) -> str:
        return self.storage_config.endpoint


@pytest.fixture(scope="session")
def stack_config(tmp_path_factory) -> BelayerConfig:
    return isolated_config(tmp_path_factory.mktemp("belayer-state"))


def running_service(stack_config, service_type, handle_type=ServiceHandle):
    """Start the session's `service_type` and yield its handle; stop it at the end."""
    stack = LocalStack(stack_config)
    service = next(s for s in stack.services if isinstance(s, service_type))
    handle = handle_type(stack, service)
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
@needs("stack")
def seaweedfs(stack_config) -> SeaweedFSHandle:
    """A private SeaweedFS with credentials enforced and the test bucket created."""
    yield from running_service(stack_config, SeaweedFS, SeaweedFSHandle)


@pytest.fixture(scope="session")
@needs("stack")
def temporal_server(stack_config) -> ServiceHandle:
    """A private Temporal dev server (sqlite file in the session's state directory)."""
    yield from running_service(stack_config, TemporalDevServer)


@pytest.fixture
def storage_config(seaweedfs) -> StorageConfig:
    """The session's storage with a key prefix of its own; its objects go afterwards."""
    prefix = f"t-{uuid.uuid4().hex[:12]}/"
    cfg = seaweedfs.storage_config.model_copy(update={"key_prefix": prefix})
    yield cfg
    if seaweedfs.process.running() is None:
        seaweedfs.start()
    delete_all_under(cfg, prefix)


def delete_all_under(cfg: StorageConfig, prefix: str) -> None:
    client = make_s3_client(cfg)
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=cfg.bucket, Prefix=prefix):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=cfg.bucket, Delete={"Objects": keys})
    for upload in client.list_multipart_uploads(Bucket=cfg.bucket, Prefix=prefix).get("Uploads", []):
        client.abort_multipart_upload(Bucket=cfg.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
