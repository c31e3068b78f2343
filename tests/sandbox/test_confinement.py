"""The container around the agent, tried from inside as an adversarial policy would.

* system calls: Belayer's seccomp profile (belayer/sandbox/seccomp.py) refuses keyrings,
  BPF, io_uring, userfaultfd and new namespaces to the agent's processes -- in a fresh
  sandbox, after a restore and in a fork, where CRIU brings the filter back;
* memory: /run and /dev/shm are tmpfs of the configured sizes, so filling them fails with
  ENOSPC inside the memory budget instead of taking the sandbox (PID 1 included) down;
* environment: the host's proxy variables never reach the sandbox.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from belayer.sandbox import seccomp
from belayer.sandbox.config import SandboxConfig
from belayer.sandbox.models import Action, ForkTarget, LoggedAction

TRAJ = "traj-confinement"
MIB = 1 << 20

# Each refused call with arguments that would reach the kernel's own checks (EINVAL,
# EFAULT, ...) if the filter let it through. Numbers per architecture: seccomp filters
# the raw call, so the probe must make it without a libc wrapper.
SYSCALL_PROBE = r"""
import ctypes, errno, json, os, threading
NUMBERS = {
    "x86_64": {"keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "userfaultfd": 323,
               "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "unshare": 272},
    "aarch64": {"keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "userfaultfd": 282,
                "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "unshare": 97},
}[os.uname().machine]
ARGS = {"keyctl": [0, 0, 0], "io_uring_setup": [1, 0], "unshare": [0x10000000]}  # KEYCTL_GET_KEYRING_ID; CLONE_NEWUSER
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for name, number in NUMBERS.items():
    r = libc.syscall(number, *[ctypes.c_long(a) for a in ARGS.get(name, [0, 0, 0, 0])])
    out[name] = errno.errorcode.get(ctypes.get_errno(), "?") if r < 0 else "ran"
t = threading.Thread(target=lambda: None); t.start(); t.join()  # clone3 refused: threads still start
out["thread"] = "ran"
print(json.dumps(out))
"""
REFUSED = {name: "EPERM" for name in seccomp.DENIED} | {"unshare": "EPERM", "thread": "ran"}


def act(step: int, command: str, trajectory: str = TRAJ) -> Action:
    return Action(trajectory=trajectory, step=step, command=command)


def run(host, handle, step: int, command: str, log: list[LoggedAction] | None = None, trajectory: str = TRAJ):
    obs = host.exec(handle, act(step, command, trajectory))
    if log is not None:
        log.append(
            LoggedAction(trajectory=trajectory, step=step, command=command, observation_sha256=obs.sha256)
        )
    return obs


# ------------------------------------------------------------------ the profile itself


def test_the_profile_is_the_installed_default_without_the_denied_calls():
    default = json.loads(seccomp.DEFAULT_PROFILE.read_text())
    text = seccomp.render(seccomp.DEFAULT_PROFILE.read_text())
    assert text == seccomp.render(seccomp.DEFAULT_PROFILE.read_text())  # deterministic
    profile = json.loads(text)
    assert profile["defaultAction"] == default["defaultAction"]
    allowed_always = {n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args")
                      for n in r["names"]}  # fmt: skip
    assert not allowed_always & set(seccomp.RESHAPED)
    # Every other call the default allows is still allowed.
    default_allowed = {n for r in default["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args")
                       and not r.get("includes") for n in r["names"]}  # fmt: skip
    assert default_allowed - set(seccomp.RESHAPED) <= allowed_always


# ------------------------------------------------------------------ seccomp, fresh / restored / forked


def _sandbox_in(sandboxes, where: str):
    """A sandbox whose agent left a background process, as it is `where`: fresh, restored
    from a checkpoint on a fresh host, or a fork of a checkpoint. Returns (handle,
    trajectory, next step, the background process's pid)."""
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    pid = run(host, handle, 1, "sleep 100000 >/dev/null 2>&1 & echo $!", log).stdout.strip()
    if where == "fresh":
        return handle, TRAJ, 2, pid
    ref = host.checkpoint(handle)
    if where == "restored":
        host.kill(handle)
        sandboxes.backend.destroy(handle.sandbox_id)
        outcome = host.recover(handle, [ref], log)
        assert outcome.consistent and outcome.source == f"checkpoint@{ref.step}", outcome
        return outcome.handle, TRAJ, 2, pid
    target = ForkTarget(sandbox_id=f"sbx-conf-{sandboxes.token[:8]}", trajectory="member-0")
    (outcome,) = host.fork(ref, [target])
    assert outcome.handle, outcome.error
    return outcome.handle, target.trajectory, 2, pid  # a fork goes on from its origin's step


@pytest.mark.parametrize("where", ["fresh", "restored", "forked"])
def test_the_agents_processes_run_under_belayers_seccomp_filter(sandboxes, where):
    host = sandboxes.host
    handle, trajectory, step, pid = _sandbox_in(sandboxes, where)
    status = run(
        host, handle, step, f"grep '^Seccomp:' /proc/self/status /proc/{pid}/status", trajectory=trajectory
    )
    assert status.stdout.split() == [
        "/proc/self/status:Seccomp:",
        "2",
        f"/proc/{pid}/status:Seccomp:",
        "2",
    ], status
    calls = run(host, handle, step + 1, f"python3 - <<'EOF'\n{SYSCALL_PROBE}EOF", trajectory=trajectory)
    assert calls.exit_code == 0, calls
    assert json.loads(calls.stdout) == REFUSED
    userns = run(host, handle, step + 2, "unshare -U true; echo exit=$?", trajectory=trajectory)
    assert userns.stdout == "exit=1\n" and "Operation not permitted" in userns.stderr, userns


# ------------------------------------------------------------------ tmpfs sizes
@pytest.mark.sandbox_config(run_mb=4, shm_mb=16)
@pytest.mark.parametrize("mount, field", [("/dev/shm", "shm_mb"), ("/run", "run_mb")])
def test_filling_a_tmpfs_stops_at_its_size_and_the_sandbox_goes_on(sandboxes, mount, field):
    host = sandboxes.host
    handle = sandboxes.create()
    size = getattr(host.cfg, field) * MIB
    fill = run(host, handle, 1, f"head -c {size + 8 * MIB} /dev/zero > {mount}/fill; stat -c %s {mount}/fill")
    assert fill.exit_code == 0 and "No space left on device" in fill.stderr, fill
    assert size - 64 * 1024 <= int(fill.stdout) <= size, fill
    assert host.ping(handle)["ok"]
    after = run(host, handle, 2, f"echo alive; rm {mount}/fill")
    assert after.stdout == "alive\n" and after.exit_code == 0, after


def test_tmpfs_sizes_that_leave_no_memory_for_processes_are_refused():
    with pytest.raises(ValidationError, match=r"run_mb 8 \+ shm_mb 300 .* exceed 3/4 of memory_mb \(1024\)"):
        SandboxConfig(shm_mb=300)


# ------------------------------------------------------------------ environment
def test_the_hosts_proxy_variables_do_not_reach_the_sandbox(sandboxes, monkeypatch):
    proxies = {"HTTP_PROXY": "http://proxy.invalid:3128", "http_proxy": "http://proxy.invalid:3128",
               "HTTPS_PROXY": "http://proxy.invalid:3129", "NO_PROXY": "internal.invalid"}  # fmt: skip
    for name, value in proxies.items():
        monkeypatch.setenv(name, value)
    host = sandboxes.host
    handle = sandboxes.create()
    pid1 = sandboxes.backend.podman("container", "inspect", "--format", "{{.State.Pid}}", handle.container)
    environ = open(f"/proc/{pid1.stdout.decode().strip()}/environ", "rb").read().decode().split("\0")
    names = {entry.partition("=")[0] for entry in environ if entry}
    assert "PATH" in names and not names & set(proxies), sorted(names)
    env = run(host, handle, 1, "env")
    assert "proxy.invalid" not in env.stdout and "internal.invalid" not in env.stdout, env
