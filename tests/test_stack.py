"""`belayer up | status | down` end to end, through the real CLI and real services."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.conftest import isolated_config
from tests.tiers import needs

BELAYER = [sys.executable, "-m", "belayer.cli"]
ROOT = Path(__file__).parents[1]


def cli_env(config) -> dict[str, str]:
    """Environment variables that point the CLI at `config`'s private services."""
    env = dict(os.environ)
    env.update(
        {
            "BELAYER_STATE_DIR": str(config.state_dir),
            "BELAYER_TEMPORAL__ADDRESS": config.temporal.address,
            "BELAYER_TEMPORAL__UI_PORT": str(config.temporal.ui_port),
            "BELAYER_STORAGE__ENDPOINT": config.storage.endpoint,
            "BELAYER_STORAGE__BUCKET": config.storage.bucket,
            "BELAYER_STORAGE__ACCESS_KEY": config.storage.access_key.get_secret_value(),
            "BELAYER_STORAGE__SECRET_KEY": config.storage.secret_key.get_secret_value(),
            "BELAYER_STACK__SEAWEEDFS_MASTER_PORT": str(config.stack.seaweedfs_master_port),
            "BELAYER_STACK__SEAWEEDFS_VOLUME_PORT": str(config.stack.seaweedfs_volume_port),
            "BELAYER_STACK__SEAWEEDFS_FILER_PORT": str(config.stack.seaweedfs_filer_port),
            "BELAYER_STACK__SEAWEEDFS_ADMIN_PORT": str(config.stack.seaweedfs_admin_port),
            "BELAYER_STACK__SERVE_PORT": str(config.stack.serve_port),
        }
    )
    return env


def belayer(env, *args, check=True, timeout: float = 180) -> subprocess.CompletedProcess:
    """`belayer ARGS` under `env`, no standard input; with `check`, a failure raises with its output."""
    result = subprocess.run(
        [*BELAYER, *args], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"belayer {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def service_status(env) -> dict[str, dict]:
    out = belayer(env, "status", "--json", check=False).stdout
    return {c["name"]: c for c in json.loads(out)["components"]}


def live_pids_under(state_dir: Path) -> list[int]:
    """Processes whose command line mentions the state directory: what we would leak."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(state_dir) in cmdline:
            found.append(proc.info["pid"])
    return found


@contextlib.contextmanager
def whole_stack(
    prefix: str,
    env_extra: dict[str, str],
    *up_args: str,
    also_leaked: Callable[[object], list[int]] = lambda config: [],
):
    """A whole private stack (`belayer up UP_ARGS`), yielding (config, env); then `down`,
    every process left killed and named, the podman storage emptied. Its state directory
    is short: podman refuses a run root path over 50 characters. The base image is
    imported into its podman storage from the install cache, as `make install` does."""
    from belayer.sandbox.runtime import run_podman

    state_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    config = isolated_config(state_dir)
    env = cli_env(config) | env_extra
    try:
        for step in (
            ["bash", "infra/install/base-image.sh"],
            ["bash", "infra/install/toolchain.sh"],
            [*BELAYER, "up", *up_args],
        ):
            done = subprocess.run(
                step, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900, cwd=ROOT
            )
            assert done.returncode == 0, f"{' '.join(step)} failed:\n{done.stdout}\n{done.stderr}"
        yield config, env
    finally:
        running = sandboxes_running(state_dir)  # what a leak below came from
        belayer(env, "down", check=False)
        leaked = [described(pid) for pid in live_pids_under(config.state_dir) + also_leaked(config)]
        for pid in leaked:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(int(pid.split()[0])).kill()
        run_podman("rmi", "--all", "--force", state_dir=state_dir, timeout=600)
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leaked, (
            f"processes left running under {config.state_dir}: {leaked}; "
            f"the first host's sandbox containers before `down`: {running or 'none'}"
        )


def sandboxes_running(state_dir: Path) -> str:
    """The first host's sandbox containers (name, status, age): none should be left once
    every test's trajectories have ended."""
    from belayer.sandbox.runtime import run_podman

    listed = run_podman("ps", "--format", "{{.Names}} {{.Status}}", state_dir=state_dir, timeout=60)
    return (
        "; ".join(listed.stdout.split("\n")).strip("; ") if listed.returncode == 0 else listed.stderr.strip()
    )


def described(pid: int) -> str:
    """`PID command line` of a process, for a message that names what leaked."""
    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:300]}"
    except psutil.Error:
        return f"{pid} (gone)"


@pytest.fixture
@needs("stack")
def private_stack(tmp_path):
    config = isolated_config(tmp_path / "state")
    env = cli_env(config)
    yield config, env
    belayer(env, "down", check=False)
    leaked = live_pids_under(config.state_dir)
    for pid in leaked:
        psutil.Process(pid).kill()
    assert not leaked, f"processes left running under {config.state_dir}: {leaked}"


async def start_parked_workflow(address: str, workflow_id: str) -> None:
    """A workflow with no worker: it exists in history only, which is what we check."""
    from temporalio.client import Client

    client = await Client.connect(address)
    await client.start_workflow("Parked", id=workflow_id, task_queue="nobody-listens")


async def workflow_exists(address: str, workflow_id: str) -> bool:
    from temporalio.client import Client

    client = await Client.connect(address)
    description = await client.get_workflow_handle(workflow_id).describe()
    return description.id == workflow_id


def test_up_status_down_round_trip_keeps_history(private_stack):
    config, env = private_stack
    belayer(env, "up", "--only", "temporal,seaweedfs")
    components = service_status(env)
    for name in ("temporal", "seaweedfs"):
        assert components[name]["healthy"], components[name]
        assert psutil.pid_exists(components[name]["pid"])

    # Running `up` twice is harmless: same processes, still healthy.
    pids_before = {n: components[n]["pid"] for n in ("temporal", "seaweedfs")}
    second = belayer(env, "up", "--only", "temporal,seaweedfs")
    assert "already running" in second.stderr
    assert {n: service_status(env)[n]["pid"] for n in pids_before} == pids_before

    asyncio.run(start_parked_workflow(config.temporal.address, "survives-down-up"))
    belayer(env, "down")
    for pid in pids_before.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not service_status(env)["temporal"]["healthy"]

    belayer(env, "up", "--only", "temporal,seaweedfs")
    assert asyncio.run(workflow_exists(config.temporal.address, "survives-down-up"))


def test_port_taken_fails_clearly_and_leaves_nothing_running(private_stack):
    config, env = private_stack
    s3_port = int(config.storage.endpoint.rsplit(":", 1)[1])
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", s3_port))
    squatter.listen()
    try:
        result = belayer(env, "up", "--only", "temporal,seaweedfs", check=False)
    finally:
        squatter.close()
    assert result.returncode == 1
    assert f"127.0.0.1:{s3_port} is already in use" in result.stderr
    assert "seaweedfs cannot start" in result.stderr
    assert "Traceback" not in result.stderr
    # Temporal had started before SeaweedFS failed: it must have been stopped again.
    assert live_pids_under(config.state_dir) == []
    assert not any(
        p.exists() and json.loads(p.read_text()) and psutil.pid_exists(json.loads(p.read_text())["pid"])
        for p in (config.state_dir / "run").glob("*.pid")
    )


@pytest.mark.usefixtures("local_processes")
def test_invalid_setting_names_field_and_fix(tmp_path):
    env = dict(os.environ, BELAYER_STATE_DIR=str(tmp_path), BELAYER_STORAGE__PART_SIZE_MB="2")
    result = belayer(env, "config", "show", check=False)
    assert result.returncode == 1
    assert "storage.part_size_mb" in result.stderr
    assert "BELAYER_STORAGE__PART_SIZE_MB" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.usefixtures("local_processes")
def test_config_show_masks_secrets(tmp_path):
    env = dict(os.environ, BELAYER_STATE_DIR=str(tmp_path), BELAYER_STORAGE__SECRET_KEY="very-secret-value")
    result = belayer(env, "config", "show", "--json")
    shown = json.loads(result.stdout)
    assert shown["storage"]["secret_key"] == "***"
    assert "very-secret-value" not in result.stdout + result.stderr
    assert shown["state_dir"] == str(tmp_path)


def test_non_root_is_told_what_still_works(monkeypatch, tmp_path):
    from belayer.config import load_config
    from belayer.stack import local

    monkeypatch.setattr(local.os, "geteuid", lambda: 1000)
    warning = local.root_warning()
    assert "checkpoint and restore of sandboxes need root (CRIU)" in warning
    assert "still work" in warning
    names = [w.name for w in local.belayer_workers(load_config(state_dir=tmp_path))]
    assert "sandbox-worker" not in names and "trajectory-worker" in names


@pytest.mark.usefixtures("local_processes")
def test_seaweedfs_server_goes_with_its_launcher_and_restarts_on_its_data(tmp_path):
    """SeaweedFS runs under the launcher of its private network (belayer/stack/private_net.py):
    a crash of the launcher (SIGKILL, what the fixtures' `kill` does) takes the server with
    it, as a crash of the server did before, so nothing is left holding the data directory,
    and a start serves the same objects again."""
    from belayer.stack.local import LocalStack
    from belayer.stack.services import SeaweedFS
    from belayer.storage.store import open_store
    from tests.conftest import SeaweedFSHandle

    stack = LocalStack(isolated_config(tmp_path / "state"))
    handle = SeaweedFSHandle(stack, next(s for s in stack.services if isinstance(s, SeaweedFS)))
    handle.start()
    try:
        with open_store(handle.storage_config, encrypted=False) as store:
            store.put_bytes("kept", b"across the crash")
        [server] = handle.process.running().children()
        handle.kill()
        psutil.wait_procs([server], timeout=10)
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
        handle.start()
        with open_store(handle.storage_config, encrypted=False) as store:
            assert store.get_bytes("kept") == b"across the crash"
    finally:
        handle.stop()
    assert live_pids_under(tmp_path / "state") == []
