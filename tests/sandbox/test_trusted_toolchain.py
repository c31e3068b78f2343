"""Belayer's own programs in a sandbox run from the trusted toolchain, whatever the agent
does to the image (belayer/sandbox/toolchain.py).

With a writable root file system (`sandbox.read_only_root` off, as a task's own image may
need) the image's python3 and tar are replaced with scripts that print a forged hash and
exit 0, a `sitecustomize` is planted in the image's standard library and a library in
/etc/ld.so.preload, and the supervisor the image carries is overwritten. The agent (uid
1000) cannot do this to files of root's; the test does it as the container's root, as a
hostile task image, or a future agent running as root, would. Then:

* the next action still runs and reports its own output and exit status (the helper that
  starts it is the toolchain's), and the workspace hash is the real one (the toolchain's
  interpreter computes it);
* a checkpoint and restore still work: CRIU's tar of each tmpfs is the host's, not the
  image's, so /workspace comes back whole, and the restored PID 1 maps nothing but the
  toolchain;
* a toolchain process started in the tampered sandbox loads nothing from the image: no
  file mapped, module imported or sys.path entry outside /.belayer;
* /.belayer itself is read-only to the agent (EROFS), and cannot be moved away;
* a second build gives the same bytes, so hosts built alike mount the same path, which a
  restore on another host needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from belayer.sandbox import toolchain
from belayer.sandbox.models import Action, LoggedAction

pytestmark = pytest.mark.sandbox_config(read_only_root=False)

TRAJ = "traj-toolchain"
FORGED_HASH = "0" * 64
# What is done to the image's own tools by whoever may write there (the container's root).
TAMPER = rf"""set -e
forged='#!/bin/sh
echo {FORGED_HASH}
exit 0'
for tool in /usr/bin/python3.11 /usr/bin/python3 /usr/bin/tar; do
  rm -f "$tool"; printf '%s\n' "$forged" > "$tool"; chmod 755 "$tool"
done
printf 'import os\nos.write(1, b"{FORGED_HASH}\\n")\nos._exit(0)\n' > /usr/lib/python3.11/sitecustomize.py
cp /usr/lib/python3.11/sitecustomize.py /opt/belayer/supervisor.py
echo /usr/lib/x86_64-linux-gnu/libpcre2-8.so.0 > /etc/ld.so.preload
echo tampered
"""
# Run by the toolchain's interpreter inside the sandbox: where everything it uses comes from.
WHERE_FROM = r"""
import json, sys
mapped = sorted({line.split(None, 5)[5].strip() for line in open("/proc/self/maps") if len(line.split()) > 5})
modules = sorted(m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None))
print(json.dumps({"prefix": sys.prefix, "path": sys.path, "mapped": [f for f in mapped if f.startswith("/")],
                  "modules": modules}))
"""
ROOT_PROBE = r"""
import errno, json, os
ops = {
    "create": lambda: os.open("/.belayer/new", os.O_WRONLY | os.O_CREAT, 0o644),
    "write": lambda: os.open("/.belayer/supervisor.py", os.O_WRONLY | os.O_APPEND),
    "chmod": lambda: os.chmod("/.belayer/lib/libc.so.6", 0o777),
    "unlink": lambda: os.unlink("/.belayer/usr/bin/python3"),
    "mkdir": lambda: os.mkdir("/.belayer/d"),
    "rename": lambda: os.rename("/.belayer/supervisor.py", "/.belayer/s"),
    "move the mount": lambda: os.rename("/.belayer", "/belayer-moved"),
}
out = {}
for name, op in ops.items():
    try:
        op()
        out[name] = "done"
    except OSError as exc:
        out[name] = errno.errorcode[exc.errno]
print(json.dumps(out))
"""


def run(host, handle, step: int, command: str, log: list[LoggedAction]):
    obs = host.exec(handle, Action(trajectory=TRAJ, step=step, command=command))
    log.append(LoggedAction(trajectory=TRAJ, step=step, command=command, observation_sha256=obs.sha256))
    return obs


def tampered_sandbox(sandboxes, log: list[LoggedAction]):
    """A sandbox with a file in /workspace (step 1) and the image's tools replaced by the
    container's root; returns (handle, the workspace hash before the tampering)."""
    host = sandboxes.host
    handle = sandboxes.create()
    assert (
        run(host, handle, 1, "mkdir -p /workspace/w && seq 1 1000 > /workspace/w/n.txt", log).exit_code == 0
    )
    before = host.workspace_hash(handle)
    refused = run(host, handle, 2, TAMPER, log)
    assert refused.exit_code != 0 and "Permission denied" in refused.stderr, refused  # not the agent's to do
    tamper = sandboxes.backend.podman("exec", handle.container, "bash", "-c", TAMPER)
    assert tamper.stdout == b"tampered\n", tamper
    return handle, before


def pid1_files(sandboxes, container: str) -> tuple[list[str], list[str]]:
    """(the command line, every file mapped) of the container's PID 1, read from the host
    (PID 1 is not dumpable: nothing inside may read its maps)."""
    pid = sandboxes.backend.podman(
        "container", "inspect", "--format", "{{.State.Pid}}", container
    ).stdout.decode()
    proc = Path("/proc", pid.strip())
    cmdline = proc.joinpath("cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
    mapped = {line.split(None, 5)[5].strip() for line in proc.joinpath("maps").read_text().splitlines()
              if len(line.split()) > 5}  # fmt: skip
    return cmdline, sorted(f for f in mapped if f.startswith("/"))


def test_after_tampering_the_next_action_still_reports_its_own_output_and_status(sandboxes):
    host = sandboxes.host
    log: list[LoggedAction] = []
    handle, _ = tampered_sandbox(sandboxes, log)
    real = run(host, handle, 3, "echo real; exit 7", log)
    assert (real.stdout, real.exit_code) == ("real\n", 7), real
    # The agent's own tools are the forged ones: the tampering took.
    forged = run(host, handle, 4, "python3 -c 'print(1)'; tar --version", log)
    assert forged.stdout == f"{FORGED_HASH}\n" * 2, forged


def test_after_tampering_the_workspace_hash_is_the_real_one(sandboxes):
    log: list[LoggedAction] = []
    handle, before = tampered_sandbox(sandboxes, log)
    assert sandboxes.host.workspace_hash(handle) == before != FORGED_HASH


def test_a_tampered_sandbox_restores_and_its_pid_1_runs_from_the_toolchain(sandboxes):
    host = sandboxes.host
    log: list[LoggedAction] = []
    handle, before = tampered_sandbox(sandboxes, log)
    ref = host.checkpoint(handle)
    host.kill(handle)
    sandboxes.backend.destroy(handle.sandbox_id)
    outcome = host.recover(handle, [ref], log)
    assert outcome.consistent and outcome.source == f"checkpoint@{ref.step}", outcome
    restored = outcome.handle
    # CRIU dumped and restored /workspace with the host's tar (the image's prints a forged hash).
    assert host.workspace_hash(restored) == before
    again = run(host, restored, 3, "python3 -c 'print(1)'; echo after; exit 5", log)
    assert (again.stdout, again.exit_code) == (f"{FORGED_HASH}\nafter\n", 5), (
        again
    )  # the agent's changes travel
    cmdline, mapped = pid1_files(sandboxes, restored.container)
    assert cmdline == toolchain.supervisor_argv(), cmdline
    outside = [f for f in mapped if not f.startswith(f"{toolchain.MOUNT}/")]
    assert mapped and not outside, outside


def test_belayers_interpreter_loads_nothing_of_the_tampered_image(sandboxes):
    log: list[LoggedAction] = []
    handle, _ = tampered_sandbox(sandboxes, log)
    out = sandboxes.backend.exec_as_root(handle.container, [*toolchain.python_command(), "-c", WHERE_FROM])
    where = json.loads(out)
    assert where["prefix"] == f"{toolchain.MOUNT}/usr", where
    for kind in ("path", "mapped", "modules"):
        outside = [f for f in where[kind] if not f.startswith(f"{toolchain.MOUNT}/")]
        assert where[kind] and not outside, (kind, outside)
    cmdline, mapped = pid1_files(sandboxes, handle.container)
    assert cmdline == toolchain.supervisor_argv(), cmdline
    assert mapped and not [f for f in mapped if not f.startswith(f"{toolchain.MOUNT}/")], mapped


def test_the_toolchain_is_read_only_to_the_agent(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    probe = run(host, handle, 1, f"python3 - <<'EOF'\n{ROOT_PROBE}EOF", [])
    assert probe.exit_code == 0, probe
    refused = json.loads(probe.stdout)
    moved = refused.pop("move the mount")
    # Writing a file the agent does not own is refused on permission before the read-only
    # mount is consulted; every other change meets the read-only mount itself.
    assert refused.pop("write") == "EACCES", refused
    assert refused == {"create": "EROFS", "chmod": "EROFS", "unlink": "EROFS", "mkdir": "EROFS",
                       "rename": "EROFS"}, refused  # fmt: skip
    assert moved != "done"  # a mount point is not renamed (EACCES on these hosts)
    intact = run(host, handle, 2, "ls /.belayer; echo still; exit 3", [])
    assert (intact.stdout, intact.exit_code) == ("drop_caps_exec.py\nlib\nsupervisor.py\nusr\nstill\n", 3), (
        intact
    )


def test_a_rebuild_gives_the_same_toolchain_at_the_same_path(sandbox_runtime, tmp_path):
    installed = toolchain.installed()
    assert installed is not None, "the sandbox_runtime fixture builds the toolchain"
    rootfs = toolchain.rootfs_tar()
    if rootfs.is_file():  # otherwise the build exports the imported base image
        (tmp_path / rootfs.name).symlink_to(rootfs)
    rebuilt = toolchain.build(tmp_path, log=lambda line: None)
    assert rebuilt.name == installed.name == toolchain.content_hash(rebuilt)
