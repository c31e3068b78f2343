"""Belayer's seccomp profile: podman's default profile as installed on the host, narrowed.

The default profile (containers-common's /usr/share/containers/seccomp.json) is the
base; `narrowed()` removes the system calls below from every rule of it and adds
Belayer's own rules for them, so the result depends only on the installed default and
on this file. Each sandbox container is created with the written profile
(`--security-opt=seccomp=<state dir>/podman/seccomp.json`); podman copies the rules into
the container's spec, and CRIU dumps and restores the filter with the processes, so a
restored or forked sandbox keeps it without reading the file again.

Denied with EPERM, and why (the agent holds no capability, and is an adversary of its
own reward: what it can reach it will use):

* `keyctl`, `add_key`, `request_key`: kernel keyrings are not the container's own -- user
  keyrings belong to the host's uid, and every sandbox maps its users to the same host
  uids (one fixed user namespace map), so they would be shared by every sandbox of the
  host -- and CRIU does not dump keys, so keys do not survive a restore;
* `bpf`: loading BPF programs and maps is kernel attack surface no task needs (the
  default already refuses it without CAP_SYS_ADMIN; denied here whatever the capabilities);
* `io_uring_setup`, `io_uring_enter`, `io_uring_register`: the operations an io_uring
  performs never pass through seccomp (a way around every rule here), its code has a long
  record of kernel exploits, and CRIU cannot dump a process holding one -- an agent could
  make every checkpoint fail;
* `userfaultfd`: lets a process stall the kernel on a page fault for as long as it likes
  (the classic way to widen a race in a kernel exploit), and CRIU cannot dump a process
  that holds one;
* `unshare` and `clone` asking for a new namespace (any CLONE_NEW* flag): a user
  namespace hands the agent every capability inside it (mount, network setup, ...), and
  CRIU cannot dump nested namespaces, so an agent could make every checkpoint fail.
  Without those flags both stay allowed (threads, processes, `unshare(CLONE_FS)`).

Refused with ENOSYS: `clone3`, whose flags sit behind a pointer that seccomp cannot read;
ENOSYS ("not implemented") makes the C library fall back to `clone`, whose flags the rules
above check.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from pathlib import Path

from belayer.sandbox.errors import RuntimeUnavailable

DEFAULT_PROFILE = Path("/usr/share/containers/seccomp.json")  # from golang-github-containers-common

DENIED = ("keyctl", "add_key", "request_key", "bpf", "io_uring_setup", "io_uring_enter", "io_uring_register",
          "userfaultfd")  # fmt: skip
NOT_IMPLEMENTED = ("clone3",)
# The namespace flags of <linux/sched.h>: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID,
# NEWNET; and NEWTIME, which only unshare takes (in clone's flags 0x80 is the exit signal).
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
UNSHARE_NAMESPACE_FLAGS = (*CLONE_NAMESPACE_FLAGS, 0x00000080)
# clone's flags are its first argument, except on s390, where they are its second.
S390 = ["s390", "s390x"]
FLAG_ARGUMENT = (
    ("clone", 0, {}, {"arches": S390}),
    ("clone", 1, {"arches": S390}, {}),
    ("unshare", 0, {}, {}),
)
RESHAPED = (*DENIED, *NOT_IMPLEMENTED, "clone", "unshare")


def narrowed(default: dict) -> dict:
    """The default profile without any rule of its own for the reshaped system calls, then
    Belayer's rules for them (the module docstring says why each)."""
    if default.get("defaultAction") not in ("SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS"):
        raise ValueError(
            f"the default seccomp profile allows what it does not name "
            f"(defaultAction {default.get('defaultAction')!r}); Belayer builds on a deny-by-default one"
        )
    rules = []
    for rule in default["syscalls"]:
        names = [n for n in rule.get("names", []) if n not in RESHAPED]
        if names:
            rules.append({**rule, "names": names})
    return {**default, "syscalls": [*rules, *_belayer_rules()]}


def _belayer_rules() -> list[dict]:
    rules = [
        _rule(DENIED, errno.EPERM, "Belayer: no keyrings, BPF, io_uring or userfaultfd (belayer/sandbox/seccomp.py)"),
        _rule(NOT_IMPLEMENTED, errno.ENOSYS, "Belayer: clone3's flags are out of seccomp's sight; libc falls back to clone"),
    ]  # fmt: skip
    for name, index, includes, excludes in FLAG_ARGUMENT:
        flags = CLONE_NAMESPACE_FLAGS if name == "clone" else UNSHARE_NAMESPACE_FLAGS
        every = sum(flags)
        scope = {"includes": includes, "excludes": excludes}
        rules.append({**_rule((name,), None, f"Belayer: {name} without a new namespace"), **scope,
                      "args": [_masked(index, every, 0)]})  # fmt: skip
        rules += [{**_rule((name,), errno.EPERM, f"Belayer: no new namespace through {name}"), **scope,
                   "args": [_masked(index, flag, flag)]} for flag in flags]  # fmt: skip
    return rules


def _rule(names: tuple[str, ...], errno_ret: int | None, comment: str) -> dict:
    if errno_ret is None:
        return {"names": list(names), "action": "SCMP_ACT_ALLOW", "comment": comment}
    return {"names": list(names), "action": "SCMP_ACT_ERRNO", "errnoRet": errno_ret, "comment": comment}


def _masked(index: int, mask: int, value: int) -> dict:
    """The argument's bits under `mask` equal `value`."""
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def render(default_text: str) -> str:
    """The profile's text from the default's: the same input always gives the same bytes."""
    return json.dumps(narrowed(json.loads(default_text)), indent=1) + "\n"


def write_profile(dest: Path, source: Path = DEFAULT_PROFILE) -> Path:
    """Write the narrowed profile of `source` to `dest` unless it already holds it; atomic, so
    processes sharing a state dir never read half a file. Returns `dest`."""
    try:
        text = render(source.read_text())
    except FileNotFoundError as exc:
        raise RuntimeUnavailable(
            f"podman's default seccomp profile {source} is missing: "
            "run infra/install/podman.sh as root (golang-github-containers-common)"
        ) from exc
    with contextlib.suppress(FileNotFoundError):
        if dest.read_text() == text:
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".seccomp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest
