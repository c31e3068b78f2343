"""The pieces of a sandbox host of its own on this machine (belayer/stack/sandbox_hosts.py),
without a stack: what it binds where, how it is launched, and that its processes are found
by its namespaces and ended together, no other process touched."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from belayer.config import load_config
from belayer.stack import sandbox_hosts
from belayer.stack.local import LocalStack

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")


@pytest.fixture
def config(tmp_path):
    return load_config(state_dir=tmp_path / "state", sandbox={"channel_root": str(tmp_path / "sbx")})


def test_every_path_a_restore_depends_on_is_the_hosts_own_at_the_shared_place(config):
    mounts = dict((target, source) for source, target in sandbox_hosts.bind_mounts(config, 2))
    own = config.state_dir / "hosts" / "h2"
    assert mounts == {
        config.state_dir / "podman": own / "podman",
        Path("/run/runc"): own / "runc",
        Path(config.sandbox.channel_root): own / "channels",
    }
    assert sandbox_hosts.host_queue(config, 2) == f"belayer-sandbox-{socket.gethostname()}-h2"
    assert sandbox_hosts.launcher(2, ["worker"])[:5] == [
        "unshare",
        "--mount",
        "--uts",
        "--propagation",
        "private",
    ]
    assert sandbox_hosts.launcher(2, ["worker"])[-4:] == ["belayer.stack.sandbox_hosts", "2", "--", "worker"]


def test_the_stack_runs_the_machine_then_hosts_of_their_own(config):
    services = {s.name: s for s in LocalStack(config, sandbox_hosts=2).services}
    machine, second = services["sandbox-worker"], services["sandbox-worker.1"]
    assert machine.command()[0][:3] == [sys.executable, "-m", "belayer.workers.sandbox"]
    argv, env = second.command()
    assert argv[0] == "unshare" and argv[-3:] == [sys.executable, "-m", "belayer.workers.sandbox"]
    assert env["BELAYER_SANDBOX__HOST_TASK_QUEUE"] == second.task_queue == sandbox_hosts.host_queue(config, 1)


@pytest.mark.usefixtures("local_processes")
def test_a_hosts_processes_are_found_by_its_namespaces_and_ended_together(config):
    own = sandbox_hosts.host_dir(config, 1)
    own.mkdir(parents=True)
    record = own / sandbox_hosts.NAMESPACES_FILE
    script = (
        f"stat -L -c %i /proc/self/ns/mnt /proc/self/ns/uts | tr '\\n' ' ' > {record}.tmp && "
        f"mv {record}.tmp {record} && sleep 600 & sleep 600"
    )
    host = subprocess.Popen(
        ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c", script]
    )
    outsider = subprocess.Popen(["sleep", "600"])
    try:
        deadline = time.monotonic() + 10
        while len(sandbox_hosts.members(config, 1)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        found = {p.pid for p in sandbox_hosts.members(config, 1)}
        assert host.pid in found and len(found) == 3 and outsider.pid not in found  # sh and two sleeps
        assert sandbox_hosts.end(config, 1) == 3
        assert not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in found
        )
        assert outsider.poll() is None, "a process outside the host was touched"
        assert not record.exists() and sandbox_hosts.members(config, 1) == []
    finally:
        outsider.kill()
        host.kill()
        host.wait(timeout=10)
        outsider.wait(timeout=10)
