"""Start one action as its user, holding no capability: the helper PID 1
(infra/sandbox/supervisor.py) runs for each action, as `drop_caps_exec.py ENV_FD UID:GID
ARGV...` through the trusted toolchain's interpreter (`python3 -I -S`, its own loader).

A file of its own, not a mode of the supervisor's: every action starts a new interpreter
for it, and the interpreter compiles the script it runs (the supervisor's 1,500 lines
cost about 11 ms of CPU per action, this file well under 1).

It runs from a fixed environment: until it becomes the action's uid it holds PID 1's
capabilities, so nothing of the agent's (LD_PRELOAD, GCONV_PATH...) may steer it; the
action's environment arrives as data in a memfd and applies only to the capability-less
shell it execs. Stdlib only, like the supervisor.
"""

import ctypes
import os
import sys

# Every action starts at the highest OOM score, so memory pressure kills the agent's
# processes before PID 1 (which keeps 0); raising one's own score needs no privilege.
AGENT_OOM_SCORE_ADJ = 1000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_caps_exec(env_fd: int, uid: int, gid: int, argv: list[str]) -> None:
    """Raise this process's OOM score (inherited by all it starts), become `uid` and `gid`
    (no supplementary groups), clear what is left of its capability sets, then exec argv
    (the action's shell) with the environment read from `env_fd`.

    Leaving uid 0 empties the effective, permitted and ambient sets; the inheritable one is
    cleared here too, and the capset clears them all for an agent that stays uid 0 (a task
    image's root): no-new-privileges then keeps its execs from regaining any, so that root
    can neither trace PID 1 nor read the journal."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(AGENT_OOM_SCORE_ADJ))
    except OSError as exc:
        print(f"drop_caps_exec: oom_score_adj {AGENT_OOM_SCORE_ADJ}: {exc}", file=sys.stderr)
    size = os.fstat(env_fd).st_size
    env = _decode_environment(os.pread(env_fd, size, 0) if size else b"")
    os.close(env_fd)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise SystemExit(f"capset failed: errno {ctypes.get_errno()}")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    os.execve(argv[0], argv, env)


def _decode_environment(data: bytes) -> dict[bytes, bytes]:
    env = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            env[name] = value
    return env


if __name__ == "__main__":
    uid, _, gid = sys.argv[2].partition(":")
    drop_caps_exec(int(sys.argv[1]), int(uid), int(gid or uid), sys.argv[3:])
