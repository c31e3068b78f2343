"""Several sandbox hosts on one machine, each as separate as a machine is where recovery
cares.

Host 0 is the machine itself: the service `sandbox-worker`, with podman's storage under
the state directory and `/run/runc` and the channel root as they are.
Host k ≥ 1 (the service `sandbox-worker.k`) runs its worker in a mount and UTS namespace
of its own (`unshare`, then `python -m belayer.stack.sandbox_hosts K -- WORKER...`):

* its host name is `<machine>-h<k>`, so its queue is `belayer-sandbox-<machine>-h<k>`;
* the paths every host uses are bind mounts of its own directories under
  `<state>/hosts/h<k>/`: podman's storage and run directories (`<state>/podman`), runc's
  state (`/run/runc`) and the supervisors' channels (`sandbox.channel_root`); a
  sandbox's network namespace is its container's own, on no path. The paths are the
  same on every host, which a restore needs (podman's `--root` and `--runroot`, the
  bind-mount sources), and what is behind them is the host's own, which a lost host
  takes with it;
* the base image is imported from the install cache's tarball before the worker starts,
  so every host holds the same image id, which a restore also needs.

Only the kernel, Temporal and the object store are shared. Everything the worker starts
(podman, conmon, CRIU, the containers) stays in its namespace, whose processes this
module can list, enter (`nsenter`) and end: `belayer down` ends them all, as switching a
machine off would, and so does a whole-host crash, which also wipes the host's storage.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from belayer.config import BelayerConfig, load_config
from belayer.sandbox import freezer
from belayer.sandbox.backend import SandboxBackend
from belayer.sandbox.backends import open_backend
from belayer.sandbox.host import default_host_queue
from belayer.sandbox.runtime import INFRA_DIR, podman_dirs, run_podman

# The inodes of the host's mount and UTS namespaces, written when it starts: a process is
# the host's when both match (one alone could be a recycled inode).
NAMESPACES_FILE = "namespaces"


def host_name(k: int) -> str:
    return socket.gethostname() if k == 0 else f"{socket.gethostname()}-h{k}"


def host_queue(config: BelayerConfig, k: int) -> str:
    return default_host_queue(config.sandbox) if k == 0 else f"belayer-sandbox-{host_name(k)}"


def host_dir(config: BelayerConfig, k: int) -> Path:
    return config.state_dir / "hosts" / f"h{k}"


def bind_mounts(config: BelayerConfig, k: int) -> list[tuple[Path, Path]]:
    """(the host's own directory, the path every host sees it at)."""
    own = host_dir(config, k)
    return [
        (own / "podman", podman_dirs(config.state_dir)["root"].parent),
        (own / "runc", Path("/run/runc")),
        (own / "channels", Path(config.sandbox.channel_root)),
    ]


def launcher(k: int, argv: list[str]) -> list[str]:
    """`argv` as the worker of host k: in new mount and UTS namespaces, set up there."""
    return [
        "unshare",
        "--mount",
        "--uts",
        "--propagation",
        "private",
        "--",
        sys.executable,
        "-m",
        "belayer.stack.sandbox_hosts",
        str(k),
        "--",
        *argv,
    ]


def enter(config: BelayerConfig, k: int) -> None:
    """Inside the fresh namespaces: this host's name, its directories over the shared paths."""
    for source, target in bind_mounts(config, k):
        source.mkdir(parents=True, exist_ok=True)
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "--bind", str(source), str(target)], check=True, capture_output=True, text=True
        )
    socket.sethostname(host_name(k))
    (host_dir(config, k) / NAMESPACES_FILE).write_text(str(_uts_namespace("self")))


def import_base_image(config: BelayerConfig) -> None:
    """The install cache's base-image tarball into this host's podman storage, and the
    trusted toolchain its sandboxes mount (built once per cache)."""
    env = dict(os.environ, BELAYER_STATE_DIR=str(config.state_dir), BELAYER_CACHE_DIR=str(config.cache_dir))
    for script in ("base-image.sh", "toolchain.sh"):
        subprocess.run(
            ["bash", str(INFRA_DIR / "install" / script)], env=env, check=True, stdin=subprocess.DEVNULL
        )


def members(config: BelayerConfig, k: int) -> list[psutil.Process]:
    """The processes in host k's UTS namespace (k ≥ 1): its worker, podman, conmon.

    Not its mount namespace: the conmon of a container in a user namespace runs in a mount
    namespace podman makes for it, and a power cut that missed it left the container
    running. Nothing of the host's but its containers (conmon's children) leaves the UTS
    namespace."""
    try:
        recorded = int((host_dir(config, k) / NAMESPACES_FILE).read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return []
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and _uts_namespace(proc.pid) == recorded:
                found.append(proc)
        except OSError:
            continue
    return found


def _uts_namespace(pid) -> int:
    return os.stat(f"/proc/{pid}/ns/uts").st_ino


def processes(config: BelayerConfig, k: int) -> list[psutil.Process]:
    """Every process of host k (k ≥ 1): its members and the containers they started (a
    container has a mount namespace of its own)."""
    found = {proc.pid: proc for proc in members(config, k)}
    for proc in list(found.values()):
        try:
            found.update((child.pid, child) for child in proc.children(recursive=True))
        except psutil.Error:
            continue
    return list(found.values())


def end(config: BelayerConfig, k: int) -> int:
    """SIGKILL every process of host k, as a machine that loses power; returns how many."""
    family = processes(config, k)
    kill_all(family)
    (host_dir(config, k) / NAMESPACES_FILE).unlink(missing_ok=True)  # those namespaces are gone
    return len(family)


def kill_all(family: list[psutil.Process], timeout_s: float = 30) -> list[psutil.Process]:
    """SIGKILL every process of `family` and wait for them; returns those still alive.

    A container caught mid-checkpoint is frozen, and its processes would keep their
    SIGKILL pending forever once CRIU (killed with them) cannot thaw it: each process's
    cgroup is thawed after the signal (belayer/sandbox/freezer.py)."""
    for proc in family:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    for proc in family:
        freezer.thaw(proc.pid)
    _, alive = psutil.wait_procs(family, timeout=timeout_s)
    return alive


def clear_volatile(config: BelayerConfig, k: int) -> None:
    """What a power cut loses and a disk keeps: runc's state, the channels and podman's run
    and temporary directories (tmpfs on a machine) go; podman's storage, with the host's
    containers in it, stays -- they come back as exited."""
    own = host_dir(config, k)
    inside = {target: source for source, target in bind_mounts(config, k)}
    volatile = [inside[Path("/run/runc")], inside[Path(config.sandbox.channel_root)]]
    podman = own / "podman"
    volatile += [podman / name for name in ("runroot", "tmp")]
    for path in volatile:
        shutil.rmtree(path, ignore_errors=True)


def wipe(config: BelayerConfig, k: int) -> None:
    """Host k's disk gone: its podman storage, runc state, channels."""
    shutil.rmtree(host_dir(config, k), ignore_errors=True)


def entry_prefix(config: BelayerConfig, k: int) -> list[str] | None:
    """The command prefix that runs a command as host k sees it: none for the machine
    itself, `nsenter` into its namespaces for k ≥ 1; None while host k is not running."""
    if not k:
        return []
    inside = members(config, k)
    return ["nsenter", "-t", str(inside[0].pid), "--mount", "--uts", "--"] if inside else None


def backend_on(config: BelayerConfig, k: int) -> SandboxBackend | None:
    """The configured sandbox backend as host k sees it; None while host k is not running."""
    prefix = entry_prefix(config, k)
    if prefix is None:
        return None
    return open_backend(config.sandbox, config.state_dir, config.cache_dir, command_prefix=prefix)


def containers_on(config: BelayerConfig, k: int) -> list[str]:
    """Every Belayer sandbox container on host k, in any state (none while it is down)."""
    backend = backend_on(config, k)
    return [] if backend is None else [name for names in backend.lineages().values() for name in names]


def run_podman_on(
    config: BelayerConfig, k: int, *args: str, timeout: float = 60.0
) -> subprocess.CompletedProcess:
    """podman with Belayer's flags as host k sees it (inside its namespaces for k ≥ 1)."""
    prefix = entry_prefix(config, k)
    if prefix is None:
        return subprocess.CompletedProcess(
            ["podman", *args], 125, "", f"sandbox host {host_name(k)} is not running"
        )
    return run_podman(
        *args, state_dir=config.state_dir, cache_dir=config.cache_dir, timeout=timeout, prefix=prefix
    )


def host_of_container(config: BelayerConfig, hosts: int, container: str) -> int | None:
    """Which of the stack's hosts holds `container`; None when none does."""
    return next((k for k in range(hosts) if container in containers_on(config, k)), None)


def host_of_sandbox(config: BelayerConfig, hosts: int, sandbox_id: str) -> int | None:
    """Which of the stack's hosts holds a container of `sandbox_id`, of any generation
    (named `<sandbox id>-g<generation>`); None when none does."""
    generation_of_it = re.compile(rf"{re.escape(sandbox_id)}-g\d+")
    return next(
        (
            k
            for k in range(hosts)
            if any(generation_of_it.fullmatch(name) for name in containers_on(config, k))
        ),
        None,
    )


def main(argv: list[str]) -> int:
    """`python -m belayer.stack.sandbox_hosts K -- WORKER...`, inside `unshare` (see `launcher`)."""

    k, separator, *worker = argv
    if separator != "--" or not worker:
        print("usage: python -m belayer.stack.sandbox_hosts K -- COMMAND...", file=sys.stderr)
        return 2
    config = load_config()
    enter(config, int(k))
    import_base_image(config)
    os.execvp(worker[0], worker)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
