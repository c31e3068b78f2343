#!/usr/bin/env python3
"""Belayer's in-sandbox supervisor: PID 1 of every sandbox container.

Runs from Belayer's trusted toolchain, mounted read-only at /.belayer/supervisor.py
(belayer/sandbox/toolchain.py): never the image's python3 or its files, which the agent
can replace when the root file system is writable. Python 3.11 standard library only:
it runs on the toolchain's Debian python3, not in Belayer's virtual environment.

What lives here, and what must not:
* a shell that persists as *state*, not as a process: each action runs in a fresh
  bash started here, and its variables (exported or not), functions and cwd are handed
  to the next action as data (see PREAMBLE). Background processes keep running (they
  re-parent to PID 1); shell options, traps, aliases, arrays and the job table do not
  carry over. This process -- never the agent's bash -- reports the exit status
  (waitpid) and frames the output, so nothing the agent defines can forge how a later
  action is delivered or reported;
* the reward check runs "isolated": a fresh bash in /workspace with the verifier's
  environment (fixed PATH, a fresh empty HOME and TMPDIR, no Python user site, no script
  directory first on sys.path, no git configuration) and none of the agent's state,
  journaled like an action. Unless the task declares `verify_with_processes: running`,
  every process the agent left is frozen (SIGSTOP, pass after pass until none runs)
  before the check starts and stays frozen through the workspace hash (the host's
  `freeze` request) until the agent's next action or a checkpoint (`quiesce`: CRIU
  cannot dump a stopped process here). What the agent can still influence is
  the file system (the point of the task); what it cannot is the check's environment,
  PATH, functions, options, status, or what the check writes while it runs;
* per-action timeout: the processes the action started are killed; a bash that is
  itself stuck (a builtin loop) is killed too, and the next action starts from the
  state of the action before; the observation says so;
* stdout/stderr captured through pipes (never files) with a byte cap: the first and
  last cap/2 bytes are kept and a marker names how many bytes were dropped, so 1 GB of
  output costs neither memory nor disk;
* exactly-once: every action carries (trajectory, step) and the sandbox generation.
  Executed ids and their observations are journaled in /var/lib/belayer/journal.jsonl;
  a repeated id returns the journaled observation without running anything; a
  request carrying another generation than the current one is refused;
* the channel: a unix socket, /run/belayer/supervisor.sock, in a per-sandbox host
  directory bind-mounted at /run/belayer. One JSON request per connection, one JSON
  reply, then close: nothing is open between requests, so a checkpoint taken between
  actions holds no connection (docs/design.md §7). Long actions are submit -> poll ("wait"
  long-polls a few seconds). Why a socket and not a FIFO pair: each connection frames
  one request and its answer, so a worker that crashed mid-poll and its retry (or a
  ping during a long action) never read each other's replies, with no reply ids and no
  single-reader rule; the price -- no connection may be open at checkpoint time -- is
  paid by the host, which serialises checkpoint and exec per sandbox;

Who may touch what. The sandbox runs in a user namespace of its own (container uid N is
host uid 200000 + N, belayer/sandbox/podman.py): its root is no user of the host's, and
CRIU, the host's root, still dumps every process in it whatever its uid. Inside, three
users: PID 1 is root with CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_FOWNER, CAP_SETUID,
CAP_SETGID and CAP_KILL only (FOWNER, unused here, is for the host's `podman exec` tar);
every action runs as the agent, uid/gid 1000, which owns /workspace and
/home/agent; the reward check runs as the verifier, uid/gid 1001, in a HOME and TMPDIR of
its own (mode 0700). Each is started through `drop_caps_exec.py`, which becomes the uid
(no supplementary groups) and so holds no capability, and the container's
no-new-privileges keeps every later exec from gaining one. That helper starts from a
fixed environment and gets the action's environment as data (a memfd), so no LD_*,
GCONV_PATH, LOCPATH or GLIBC_TUNABLES of the agent's applies while it holds a
capability; those names are not carried between actions either. The agent therefore
cannot read what the verifier keeps to itself, nor signal or trace its processes, nor
touch PID 1's: PID 1 needs CAP_KILL to stop and kill the processes of both (the freezer,
timeouts). The helper raises the action's oom_score_adj to 1000 while PID 1 keeps 0, so
an OOM kill takes the agent's processes, not PID 1; no process here holds
CAP_SYS_RESOURCE, so nothing goes below 0, and PID 1's score is root's to write, not the
agent's. The journal (a tmpfs at /var/lib/belayer) and the channel directory are owned
by uid 999 with mode 0700: neither the agent nor the verifier can enter them; only PID 1
keeps CAP_DAC_OVERRIDE (to reach them) and CAP_CHOWN (to hand the journal to 999, and
/workspace and /home/agent to the agent, at start). PID 1 is another uid than the
agent's, so the agent cannot ptrace it or open /proc/1/fd, /proc/1/mem or
/proc/1/environ. (PID 1 is no longer marked non-dumpable, which was how it kept these
from an agent of its own uid: a task CRIU restores has its memory owned by the host's
user namespace, and CRIU, which checks the sandbox's processes from inside the
sandbox's user namespace, could then never dump a non-dumpable PID 1 again.) It handles
SIGINT, SIGTERM, SIGHUP, SIGQUIT (and the other signals whose default would end it) by
doing nothing, and no error ends its main loop (podman removes sandboxes with SIGKILL).
The root file system is read-only unless a task's image needs it writable
(sandbox.read_only_root); the rest that is writable is a size-limited tmpfs.

No host-side policy lives here (limits, checkpoints, storage): only what must run
inside the container. Local mode (BELAYER_SUPERVISOR_LOCAL=1) runs it as an ordinary
process for tests: no capability changes, and only the shell's session is ever killed.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import itertools
import json
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable

VERSION = 1
LOCAL = os.environ.get("BELAYER_SUPERVISOR_LOCAL") == "1"
CHANNEL_DIR = os.environ.get("BELAYER_CHANNEL_DIR", "/run/belayer")
JOURNAL_DIR = os.environ.get("BELAYER_JOURNAL_DIR", "/var/lib/belayer")
GUARD_UID = 999  # owner of the journal and channel: not the agent, not reachable by it


def resolve_user(spec: str, passwd: str = "/etc/passwd") -> tuple[int, int, str, str]:
    """(uid, gid, home, name) of a user as Harbor and Dockerfiles name one: `name`, `uid`,
    `name:group` or `uid:gid`, looked up in the image's /etc/passwd (read here, at start,
    before any action of the agent's: PID 1 trusts the image as it was built). A numeric
    uid the file lacks is still that uid (gid the same, home /)."""
    user, _, group = spec.partition(":")
    entries = {}
    try:
        with open(passwd, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.rstrip("\n").split(":")
                if len(fields) >= 6 and fields[2].isdigit() and fields[3].isdigit():
                    entries[fields[0]] = (int(fields[2]), int(fields[3]), fields[5] or "/", fields[0])
    except OSError:
        pass
    by_uid = {uid: entry for uid, entry in ((e[0], e) for e in entries.values())}
    if user.isdigit():
        found = by_uid.get(int(user), (int(user), int(user), "/", user))
    elif user in entries:
        found = entries[user]
    else:
        raise SystemExit(f"supervisor: user {user!r} is not in the image's {passwd}")
    gid = int(group) if group.isdigit() else found[1]
    return found[0], gid, found[2], found[3]


# Every action runs as the agent (by default uid/gid 1000, which owns /workspace and
# /home/agent), the reward check as the verifier (by default 1001: the agent can neither
# signal nor read it). A task's own image may name others (Harbor's `[agent].user`,
# `[verifier].user`, the image's USER; root by default): the host passes them.
AGENT_UID, AGENT_GID, _AGENT_PASSWD_HOME, AGENT_NAME = resolve_user(os.environ.get("BELAYER_AGENT_USER", "1000:1000"))
VERIFIER_UID, VERIFIER_GID, _, VERIFIER_NAME = resolve_user(os.environ.get("BELAYER_VERIFIER_USER", "1001:1001"))
# The image's own environment and the task's (JSON), for a task image run as it was built:
# then the agent's first action starts from it, not from Belayer's fixed one.
IMAGE_ENV: dict[str, str] | None = json.loads(os.environ["BELAYER_AGENT_ENV"]) if "BELAYER_AGENT_ENV" in os.environ else None
AGENT_HOME = os.environ.get("BELAYER_AGENT_HOME", _AGENT_PASSWD_HOME if IMAGE_ENV is not None else "/home/agent")
WORKSPACE = os.environ.get("BELAYER_WORKSPACE", "/workspace")
# Hand /workspace and the agent's home to the agent at start (Belayer's own sandboxes); a
# task image keeps the owners its build gave them.
HAND_OVER = os.environ.get("BELAYER_HAND_OVER", "1") == "1"
RUN_DIRS = ("/run", "/run/lock")
UNMAPPED_UID = 65534  # the kernel's overflowuid: how a file of a uid outside the namespace's map shows
SOCKET_NAME = "supervisor.sock"
MAX_REQUEST = 8 * 1024 * 1024
MAX_WAIT_S = 5.0
# After a timeout kill, how long the shell gets to report the killed command's status
# before it is considered stuck itself and replaced.
SHELL_GRACE_S = 2.0
SETUP_TRAJECTORY = "__setup__"
KEEP_FULL_OBSERVATIONS = 32

# How one action runs. A fresh bash per action, started by this supervisor, which alone
# reports the exit status (waitpid), frames the output (it writes the end-of-output
# sentinel itself, after the process exited) and keeps the shell state between actions
# as data. Nothing of the agent's -- functions, aliases, traps, options, enable -n,
# readonly variables -- lives in a process that delivers or reports the next action.
#
# The program starts in posix mode (`bash --posix`), so the carried functions are
# imported as pure definitions (bash refuses anything else in BASH_FUNC_* values) and
# none may be named like a special builtin (trap, exit, eval, export, unset, set...):
# the preamble's special builtins are therefore the real ones. It then reads the
# action text from a memfd, installs the EXIT trap that dumps the state as NUL-separated
# data into another memfd, leaves posix mode, restores which variables were unexported, and evals
# the action. The trap runs after the action with the agent's functions in scope, so it
# first removes a function named `builtin` and then calls only `builtin ...`, special
# builtins and /usr/bin/env by absolute path; what an action defines can only spoil the
# state it hands on (its own), never another action's exit status or output.
PREAMBLE = r"""__belayer_action=$(< /dev/fd/{TEXT})
exec {TEXT}<&-
trap '__belayer_rc=$?
unset -f builtin
builtin set +e +u +o pipefail +x +v 2>/dev/null
unset IFS
{ builtin export -f -- $(builtin compgen -A function)
  __belayer_exported=$(builtin compgen -e)
  builtin export -- $(builtin compgen -v)
  __belayer_exported=$__belayer_exported /usr/bin/env -0 >&{DUMP}
} 2>/dev/null
exit "$__belayer_rc"' EXIT
set +o posix
"""
ACTION_EVAL = 'eval "$__belayer_action"\n'
# Special builtins: bash refuses to import a function of these names in posix mode.
SPECIAL_BUILTINS = frozenset(
    "break : . continue eval exec exit export readonly return set shift times trap unset source".split()
)
# Variables bash owns, or that change how bash starts: never carried to the next action.
NOT_CARRIED = frozenset(
    "_ SHLVL BASH_ENV ENV SHELLOPTS BASHOPTS POSIXLY_CORRECT PPID UID EUID GROUPS HOSTNAME HOSTTYPE "
    "MACHTYPE OSTYPE HISTCMD LINENO RANDOM SRANDOM SECONDS EPOCHREALTIME EPOCHSECONDS FUNCNAME "
    "PIPESTATUS DIRSTACK OPTIND OPTARG OPTERR IFS PS4 COLUMNS LINES".split()
)
# Variables the dynamic loader and glibc read at every exec: an agent that exports them
# steers how the next program is loaded (LD_PRELOAD, LD_DEBUG_OUTPUT, GCONV_PATH...). They
# never reach a process holding a capability (the helper starts from a fixed environment)
# and are not carried to the next action either: an agent sets them per command.
LOADER_VARIABLES = frozenset("GCONV_PATH LOCPATH GLIBC_TUNABLES NLSPATH HOSTALIASES RESOLV_HOST_CONF".split())
LOADER_PREFIXES = ("LD_", "MALLOC_")
# OOM scores. No process on these hosts holds CAP_SYS_RESOURCE, so none can go below the
# floor it inherited (0) and none can move the floor: PID 1 keeps 0, every action starts
# at 1000 (raising needs no privilege), so memory pressure kills the agent's processes.
# An agent may lower its own to 0, but not raise PID 1's (another uid's): an OOM kill of
# PID 1 is still possible when the agent's processes hold the memory at 0, and is the
# sandbox's own, counted as the agent's failure by the host. (The actions' 1000 is
# drop_caps_exec.py's AGENT_OOM_SCORE_ADJ.)
PID1_OOM_SCORE_ADJ = 0
# Signals the agent may send PID 1 from inside: each gets a handler that does nothing, so
# none of them ends PID 1 (Python's own SIGINT handler would raise KeyboardInterrupt).
IGNORED_BY_PID1 = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                   signal.SIGUSR2, signal.SIGALRM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
# How long the freezer passes before it gives up on a sandbox whose processes keep running
# (a pass stops everything it sees; a stopped process cannot fork). A process stops when it
# next leaves the kernel, which on a loaded host takes a while: 200 passes (2 s) were not
# always enough. Below the host's 30 s wait for the reply.
FREEZE_DEADLINE_S = 20.0
# How long resuming before a checkpoint passes: best effort, below the host's 10 s wait for
# `quiesce` (an agent that keeps stopping a process wins this race; the dump watchdog then
# fails the checkpoint as the agent's doing).
RESUME_DEADLINE_S = 3.0
SIGSTOP_BIT = 1 << (signal.SIGSTOP - 1)
MAX_ENTRY_BYTES = 128 * 1024 - 1  # execve's MAX_ARG_STRLEN: a longer entry makes the next exec fail
MAX_STATE_BYTES = 1 << 20
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def log(msg: str) -> None:
    try:
        sys.stderr.write(f"[supervisor] {msg}\n")
        sys.stderr.flush()
    except OSError:
        pass


# ----------------------------------------------------------------------------- capture


def observation_hash(exit_code: int, out_b64: str, err_b64: str, timed_out: bool) -> str:
    """Same formula as belayer.sandbox.models.observation_hash (kept there for the host)."""
    out, err = base64.b64decode(out_b64), base64.b64decode(err_b64)
    h = hashlib.sha256()
    h.update(json.dumps([exit_code, timed_out, len(out), len(err)]).encode())
    h.update(out)
    h.update(err)
    return h.hexdigest()


class Capture:
    """One action's stream: head and tail kept up to the cap, the middle only counted."""

    def __init__(self, nonce: str, cap: int):
        self.sentinel = b"\x1e" + nonce.encode() + b"\x1e"
        self.head_cap = cap - cap // 2
        self.tail_cap = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.pending = b""  # bytes that may be the start of the sentinel
        self.done = threading.Event()

    def feed(self, data: bytes) -> None:
        buf = self.pending + data
        idx = buf.find(self.sentinel)
        if idx >= 0:
            self._keep(buf[:idx])
            self.pending = b""
            self.done.set()
            return
        # Hold back a possible partial sentinel at the end of the chunk.
        hold = 0
        for n in range(min(len(self.sentinel) - 1, len(buf)), 0, -1):
            if self.sentinel.startswith(buf[-n:]):
                hold = n
                break
        self._keep(buf[: len(buf) - hold])
        self.pending = buf[len(buf) - hold :] if hold else b""

    def _keep(self, data: bytes) -> None:
        if not data:
            return
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap > 0:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def finish(self) -> dict:
        self._keep(self.pending)
        self.pending = b""
        tail = bytes(self.tail[-self.tail_cap :]) if self.tail_cap else b""
        kept = len(self.head) + len(tail)
        dropped = self.total - kept
        if dropped > 0:
            marker = f"\n[... {dropped} bytes truncated by Belayer (output cap) ...]\n".encode()
            data = bytes(self.head) + marker + tail
        else:
            data = bytes(self.head) + tail
        return {"b64": base64.b64encode(data).decode(), "total": self.total, "dropped": max(dropped, 0)}


class StreamReader(threading.Thread):
    """Drains one shell pipe forever; bytes go to the current action's capture or nowhere."""

    def __init__(self, fd: int, name: str):
        super().__init__(name=name, daemon=True)
        self.fd = fd
        self.lock = threading.Lock()
        self.capture: Capture | None = None

    def attach(self, capture: Capture | None) -> None:
        with self.lock:
            self.capture = capture

    def run(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                with self.lock:
                    if self.capture is not None:
                        self.capture.done.set()
                try:
                    os.close(self.fd)
                except OSError:
                    pass
                return
            with self.lock:
                if self.capture is not None and not self.capture.done.is_set():
                    self.capture.feed(data)


# ------------------------------------------------------------------------------- shell


def _proc_start(pid: int) -> tuple[int, int, int] | None:
    """(start time, session id, parent pid) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19]), int(fields[3]), int(fields[1])


def list_processes() -> dict[int, tuple[int, int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = _proc_start(int(name))
            if info is not None:
                out[int(name)] = info
    return out


def _thread_states(pid: int) -> list[str]:
    """The state letter (R, S, D, T, t, Z...) of each thread of a process; none when it is
    gone. Every thread counts: a leader that exited (Z) may leave its threads running."""
    states = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return states
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        states.append(stat[stat.rfind(b")") + 2 :][:1].decode())
    return states


def _stop_pending(pid: int) -> bool:
    """Whether a SIGSTOP waits in the process's shared pending set (not yet taken by a thread)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("ShdPnd:"):
                    return bool(int(line.split()[1], 16) & SIGSTOP_BIT)
    except (OSError, ValueError):
        pass
    return False


def may_run(pid: int) -> bool:
    """Whether a process may still run its own code: a thread neither stopped nor exited.
    One in uninterruptible sleep (D) with a SIGSTOP pending does not: it stops before it
    returns from the kernel, however long it sleeps there (a write throttled under disk
    pressure; a vfork parent, whose stopped child never execs); and it cannot fork before
    (a pending signal aborts a fork)."""
    states = [state for state in _thread_states(pid) if state not in ("T", "t", "Z", "X", "x")]
    return bool(states) and not (set(states) == {"D"} and _stop_pending(pid))


def _exited(pid: int) -> bool:
    """Whether every thread of a process has exited (a zombie waiting for its parent)."""
    return set(_thread_states(pid)) <= {"Z", "X", "x"}


def has_stopped_thread(pid: int) -> bool:
    return "T" in _thread_states(pid)


class FreezeFailed(Exception):
    """The agent's processes kept running through every freezing pass."""


def signal_until_none(
    signum: int, wanted: Callable[[int, tuple], bool], deadline_s: float = FREEZE_DEADLINE_S
) -> tuple[dict[int, int], bool]:
    """Send `signum` to every process `wanted(pid, info)` selects (never PID 1
    nor this one), pass after pass, until a pass selects none: what a pass signals cannot
    hide the next one's targets (a stopped process cannot fork; a resumed one may stop
    another). Returns pid -> start time of every process signalled, and whether a pass
    found none left (False: `deadline_s` ran out first; the caller decides whether that
    is an error, and still owns what was signalled)."""
    me, signalled = os.getpid(), {}
    deadline = time.monotonic() + deadline_s
    for attempt in itertools.count():
        if attempt >= 10:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)  # a process waits for the CPU, or sleeps in the kernel, to take the signal
        targets = [
            (pid, info[0]) for pid, info in list_processes().items()
            if pid not in (me, 1) and wanted(pid, info)
        ]  # fmt: skip
        if not targets:
            return signalled, True
        for pid, start in targets:
            try:
                os.kill(pid, signum)
                signalled.setdefault(pid, start)
            except OSError:
                pass
    return signalled, False


class Freezer:
    """Stops the agent's processes for the check and the workspace hash, and resumes them.

    Every process but PID 1 is the agent's in a sandbox, or one a check left (locally:
    only those in the sessions of actions this supervisor started); PID 1 stops them
    whatever their uid (CAP_KILL). A pass SIGSTOPs every one that is not
    stopped; passes repeat until one finds none running, so a respawner (a stopped
    process cannot fork) or one sending SIGCONT to another cannot escape. What was
    stopped here is resumed (SIGCONT) before the agent's next action, and only if it is
    still the same process; what the agent had stopped itself stays stopped. Before a
    checkpoint every stopped process is resumed (`resume_all`: CRIU cannot dump one here).
    """

    def __init__(self):
        self.frozen: dict[int, int] = {}  # pid -> start time

    def freeze(self, sessions: set[int]) -> int:
        def running(pid: int, info: tuple) -> bool:
            return (not LOCAL or info[1] in sessions) and may_run(pid)

        stopped, settled = signal_until_none(signal.SIGSTOP, running)
        for pid, start in stopped.items():  # resumed at the next action, even when this fails
            self.frozen.setdefault(pid, start)
        if not settled:
            raise FreezeFailed(
                f"the agent's processes could not be frozen: still running after {FREEZE_DEADLINE_S:g} s"
            )
        return len(self.frozen)

    def resume_all(self, sessions: set[int]) -> int:
        """SIGCONT every stopped process of the agent's, pass after pass until none is left
        stopped (a running one may stop another); returns how many were resumed."""
        self.thaw()

        def stopped(pid: int, info: tuple) -> bool:
            return (not LOCAL or info[1] in sessions) and has_stopped_thread(pid)

        resumed, _ = signal_until_none(signal.SIGCONT, stopped, RESUME_DEADLINE_S)
        return len(resumed)

    def thaw(self) -> None:
        for pid, start in self.frozen.items():
            info = _proc_start(pid)
            if info is not None and info[0] == start:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
        self.frozen.clear()


def process_limit_note(what: str, exc: BaseException) -> str:
    """Why an action did not run when the sandbox is out of pids: the agent's own doing
    (e.g. a background fork bomb), so it reads as the action's observation, with the fix."""
    return (
        f"{what}: {exc}; the sandbox's process limit is exhausted "
        f"({len(list_processes())} processes): kill some, or recover the sandbox"
    )


def _base_environment() -> dict[str, str]:
    """The environment of the first action, and of every isolated (judge) process."""
    if LOCAL:
        return {k: v for k, v in os.environ.items() if not k.startswith("BELAYER_")}
    if IMAGE_ENV is not None:
        return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": AGENT_HOME,
                "USER": AGENT_NAME, "LOGNAME": AGENT_NAME, "SHELL": "/bin/bash", **IMAGE_ENV}
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": AGENT_HOME,
        "USER": "agent",
        "LOGNAME": "agent",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _verifier_environment(home: str, tmp: str) -> dict[str, str]:
    """The check's environment: the base one with a fresh empty HOME and TMPDIR of its own, and
    nothing a planted file can use to run code in the check's interpreters: no user site
    (`~/.local/.../*.pth`, usercustomize), no script directory or cwd first on sys.path (a
    /workspace/json.py shadowing the standard library), no git configuration but the repo's."""
    env = _base_environment()
    if not LOCAL:
        name = VERIFIER_NAME if IMAGE_ENV is not None else "verifier"
        env.update({"USER": name, "LOGNAME": name})
    env.update({
        "HOME": home, "TMPDIR": tmp, "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1",
    })  # fmt: skip
    return env


class VerifierDirs:
    """A fresh HOME and TMPDIR for one check, under /tmp, removed when the check ends.

    They are the verifier's (uid 1001, mode 0700): the agent can neither enter nor read
    them, and they are thrown away before its processes resume."""

    def __init__(self):
        import tempfile

        self.root = tempfile.mkdtemp(prefix="belayer-verifier-", dir=_verifier_parent())
        self.home = os.path.join(self.root, "home")
        self.tmp = os.path.join(self.root, "tmp")
        os.mkdir(self.home, 0o700)
        os.mkdir(self.tmp, 0o700)
        if not LOCAL:
            for path in (self.root, self.home, self.tmp):
                os.chown(path, VERIFIER_UID, VERIFIER_GID)

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


def _verifier_parent() -> str:
    return os.environ.get("BELAYER_VERIFIER_TMP", "/tmp") if LOCAL else "/tmp"


def _workspace_dir() -> str:
    return WORKSPACE if os.path.isdir(WORKSPACE) else "/"


class ShellState:
    """What one action hands on to the next, as data: variables, functions, cwd.

    Variables and functions travel in the next bash's environment (functions as
    BASH_FUNC_name%% entries, which bash imports as definitions only); `unexported`
    names the variables the preamble un-exports again. Not carried: shell options,
    traps, aliases, arrays and the job table (background processes keep running).
    """

    def __init__(self, env: dict[str, str], unexported: list[str], cwd: str):
        self.env = env
        self.unexported = unexported
        self.cwd = cwd

    @classmethod
    def initial(cls) -> ShellState:
        return cls(_base_environment(), [], _workspace_dir())

    @classmethod
    def from_dump(cls, dump: bytes, previous: ShellState) -> tuple[ShellState, list[str]]:
        """Parse the EXIT trap's `env -0` dump; keep only what a next bash can safely start with."""
        entries: dict[str, str] = {}
        for raw in dump.split(b"\0"):
            name, sep, value = raw.decode("utf-8", "surrogateescape").partition("=")
            if sep:
                entries[name] = value
        exported = set(entries.pop("__belayer_exported", "").split("\n"))
        env: dict[str, str] = {}
        unexported: list[str] = []
        too_long: list[str] = []
        loader = sorted(name for name in entries if _loader_variable(name))
        for name, value in entries.items():
            if len(name.encode("utf-8", "surrogateescape")) + len(value.encode("utf-8", "surrogateescape")) >= MAX_ENTRY_BYTES:
                too_long.append(name)
            elif _carried_function(name, value):
                env[name] = value
            elif _carried_variable(name):
                env[name] = value
                if name not in exported:
                    unexported.append(name)
        if sum(len(k) + len(v) + 2 for k, v in env.items()) > MAX_STATE_BYTES:
            return previous, [f"the shell state passed {MAX_STATE_BYTES} bytes: the previous action's is kept"]
        notes = [f"not carried to the next action (over {MAX_ENTRY_BYTES} bytes): {', '.join(too_long)}"] if too_long else []
        if loader:
            notes.append(f"not carried to the next action (loader variables, set them per command): {', '.join(loader)}")
        cwd = env.get("PWD", "")
        if not (cwd.startswith("/") and os.path.isdir(cwd)):
            cwd = previous.cwd if os.path.isdir(previous.cwd) else _workspace_dir()
        return cls(env, unexported, cwd), notes

    def program(self, text_fd: int, dump_fd: int) -> str:
        preamble = PREAMBLE.replace("{TEXT}", str(text_fd)).replace("{DUMP}", str(dump_fd))
        unexport = f"export -n -- {' '.join(self.unexported)}\n" if self.unexported else ""
        return preamble + unexport + ACTION_EVAL


def _carried_function(name: str, value: str) -> bool:
    if not (name.startswith("BASH_FUNC_") and name.endswith("%%") and value.startswith("() {")):
        return False
    fname = name[len("BASH_FUNC_") : -2]
    return bool(_IDENTIFIER.match(fname)) and fname not in SPECIAL_BUILTINS


def _carried_variable(name: str) -> bool:
    return (
        bool(_IDENTIFIER.match(name))
        and name not in NOT_CARRIED
        and not _loader_variable(name)
        and not name.startswith(("BASH", "COMP_", "__belayer_"))
    )


def _loader_variable(name: str) -> bool:
    return name in LOADER_VARIABLES or name.startswith(LOADER_PREFIXES)


class ActionStreams:
    """The two output pipes every action writes to, drained for the whole sandbox life.

    The supervisor keeps the write ends too: background processes never see EPIPE, and
    after an action's bash has exited the supervisor writes that action's sentinel
    behind everything bash wrote. The sentinel's nonce never enters the sandbox.
    """

    def __init__(self):
        out_r, self.out_w = os.pipe()
        err_r, self.err_w = os.pipe()
        self.out = StreamReader(out_r, "stdout")
        self.err = StreamReader(err_r, "stderr")
        self.out.start()
        self.err.start()

    def attach(self, out: Capture | None, err: Capture | None) -> None:
        self.out.attach(out)
        self.err.attach(err)

    def close_action(self, nonce: str) -> None:
        sentinel = b"\x1e" + nonce.encode() + b"\x1e"
        for fd in (self.out_w, self.err_w):
            os.write(fd, sentinel)


def spawn_action(command: bytes, state: ShellState, streams: ActionStreams,
                 user: tuple[int, int]) -> tuple[int, int]:
    """Start one action's bash as `user` (uid, gid); returns (pid, fd of the state dump its EXIT trap writes).

    In a sandbox the bash is started by the capability-dropping helper
    (drop_caps_exec.py, beside this file), which holds PID 1's capabilities until it becomes `uid` and execs:
    it starts from a fixed environment (nothing of the agent's -- LD_PRELOAD,
    LD_DEBUG_OUTPUT, GCONV_PATH -- can steer how it is loaded while it holds them) and
    receives the action's environment as data in a memfd, which applies only to the
    capability-less bash. Locally `user` is ignored: everything runs as the test's user."""
    text_fd = _high_fd(os.memfd_create("belayer-action"))
    dump_fd = _high_fd(os.memfd_create("belayer-state"))
    env_fd = None
    try:
        os.write(text_fd, command)
        argv = ["/bin/bash", "--posix", "--noprofile", "--norc", "-c", state.program(text_fd, dump_fd)]
        env, pass_fds = state.env, (text_fd, dump_fd)
        if not LOCAL:
            env_fd = _high_fd(os.memfd_create("belayer-env"))
            os.write(env_fd, _encode_environment(state.env))
            argv = [*HELPER_INTERPRETER, DROP_CAPS_EXEC, str(env_fd), f"{user[0]}:{user[1]}", *argv]
            env, pass_fds = HELPER_ENVIRONMENT, (text_fd, dump_fd, env_fd)
        with open(os.devnull, "rb") as null:
            proc = subprocess.Popen(
                argv, stdin=null, stdout=streams.out_w, stderr=streams.err_w, pass_fds=pass_fds,
                cwd=state.cwd, env=env, start_new_session=True,
            )  # fmt: skip
    except BaseException:
        os.close(dump_fd)
        raise
    finally:
        os.close(text_fd)
        if env_fd is not None:
            os.close(env_fd)
    proc.returncode = 0  # the reaper owns the exit status; Popen must never wait on this pid
    return proc.pid, dump_fd


# The helper's own environment while it holds capabilities: fixed, never the agent's. The
# C locale is glibc's own: no locale file of the image is read.
HELPER_ENVIRONMENT = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
# The command that runs this file as the helper: the trusted toolchain's interpreter
# through its own loader (`--interpreter ...` on PID 1's command line, from
# belayer/sandbox/toolchain.py), never the image's python3, which the agent can replace
# when the root file system is writable. sys.executable would not do: it names the
# toolchain's python3, which the image's loader and libraries would run.
HELPER_INTERPRETER: list[str] = []
# The helper itself, beside this file in the toolchain (infra/sandbox/drop_caps_exec.py).
DROP_CAPS_EXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drop_caps_exec.py")


def _encode_environment(env: dict[str, str]) -> bytes:
    return b"".join(
        k.encode("utf-8", "surrogateescape") + b"=" + v.encode("utf-8", "surrogateescape") + b"\0"
        for k, v in env.items()
    )


def _high_fd(fd: int) -> int:
    """Far above the fds an agent's command is likely to redirect (and close-on-exec here)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)
    os.close(fd)
    return high


def read_dump(dump_fd: int) -> bytes:
    try:
        size = os.fstat(dump_fd).st_size
        return os.pread(dump_fd, min(size, MAX_STATE_BYTES + 1), 0) if size else b""
    finally:
        os.close(dump_fd)


class Reaper:
    """PID 1 duty: reap every child, orphans included; keep the shells' exit statuses."""

    def __init__(self):
        self.lock = threading.Condition()
        self.statuses: dict[int, int] = {}
        # Set when a child is started: with no child, waitpid fails at once and the loop
        # sleeps; a new action's bash must not wait out that sleep.
        self.child_started = threading.Event()

    def run_forever(self) -> None:
        """PID 1's main loop: nothing that happens to one iteration ends it (if PID 1
        exits, the kernel kills every process in the sandbox)."""
        while True:
            try:
                self._reap_one()
            except BaseException as exc:  # noqa: BLE001 -- PID 1 must outlive any error
                log(f"reaper: {type(exc).__name__}: {exc}")
                time.sleep(0.05)

    def _reap_one(self) -> None:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            self.child_started.wait(0.2)
            self.child_started.clear()
            return
        except InterruptedError:
            return
        with self.lock:
            self.statuses[pid] = status
            if len(self.statuses) > 4096:
                for k in list(self.statuses)[:2048]:
                    del self.statuses[k]
            self.lock.notify_all()

    def wait_for(self, pid: int, timeout: float) -> int | None:
        """The wait status of `pid` once reaped, or None when `timeout` passes first."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while pid not in self.statuses:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.lock.wait(left)
            return self.statuses.pop(pid)


# ----------------------------------------------------------------------------- journal


class RequestError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Journal:
    """Executed action ids and their observations, append-only, outside the agent's reach."""

    def __init__(self, directory: str):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.path = os.path.join(directory, "journal.jsonl")
        self.entries: dict[tuple[str, int], dict] = {}
        self.order: dict[tuple[str, int], int] = {}
        self.heads: dict[str, int] = {}
        self.generation = 0
        self.trajectory: str | None = None
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                for line in f:
                    try:
                        self._apply(json.loads(line))
                    except ValueError:
                        continue  # a torn last line
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if not LOCAL:
            os.fchown(self.fd, GUARD_UID, GUARD_UID)

    def _apply(self, rec: dict) -> None:
        if rec.get("type") == "generation":
            self.generation = int(rec["generation"])
        elif rec.get("type") == "action":
            key = (rec["trajectory"], int(rec["step"]))
            self.entries[key] = rec["observation"]
            self.order[key] = len(self.order) if key not in self.order else self.order[key]
            self.heads[key[0]] = max(self.heads.get(key[0], 0), key[1])
            if key[0] != SETUP_TRAJECTORY:
                self.trajectory = key[0]
        elif rec.get("type") == "fork":
            self._take_over(str(rec["trajectory"]))
            self.generation = int(rec["generation"])

    def _take_over(self, trajectory: str) -> None:
        """A fork's identity: the steps it inherited become `trajectory`'s own, so the
        fork answers them from the journal (replay-verify) while the parent's ids, and
        any other trajectory's, are foreign from now on."""
        parent = self.trajectory
        if parent is not None and parent != trajectory:
            for key in [k for k in self.entries if k[0] == parent]:
                new_key = (trajectory, key[1])
                self.entries[new_key] = self.entries.pop(key)
                self.order[new_key] = self.order.pop(key)
            self.heads[trajectory] = self.heads.pop(parent, 0)
        self.trajectory = trajectory

    def append(self, rec: dict) -> None:
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        try:
            os.write(self.fd, line)
        except OSError:
            # The journal tmpfs is full: keep full observations only for the latest
            # actions (the ones a retry can ask for), older ones keep exit code and hash.
            self._compact()
            os.write(self.fd, line)
        self._apply(rec)

    def _compact(self, keep_full: int = KEEP_FULL_OBSERVATIONS) -> None:
        latest = sorted(self.entries, key=lambda k: self.order.get(k, 0))[-keep_full:]
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, (json.dumps({"type": "generation", "generation": self.generation}) + "\n").encode())
            if self.trajectory is not None:  # a fork's identity, before its steps exist
                os.write(fd, (json.dumps({"type": "fork", "trajectory": self.trajectory,
                                          "generation": self.generation}) + "\n").encode())
            for key in sorted(self.entries, key=lambda k: self.order.get(k, 0)):
                obs = self.entries[key]
                if key not in latest and not obs.get("compacted"):
                    obs = dict(obs, stdout={"b64": "", "total": obs["stdout"]["total"], "dropped": 0},
                               stderr={"b64": "", "total": obs["stderr"]["total"], "dropped": 0},
                               compacted=True)  # fmt: skip
                    self.entries[key] = obs
                rec = {"type": "action", "trajectory": key[0], "step": key[1], "observation": obs}
                os.write(fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())
        finally:
            os.close(fd)
        if not LOCAL:
            os.chown(tmp, GUARD_UID, GUARD_UID)
        os.replace(tmp, self.path)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def head(self, trajectory: str | None) -> int:
        t = trajectory if trajectory is not None else self.trajectory
        return self.heads.get(t, 0) if t is not None else 0


# -------------------------------------------------------------------------- supervisor


class Supervisor:
    def __init__(self, reaper: Reaper):
        self.reaper = reaper
        self.journal = Journal(JOURNAL_DIR)
        self.lock = threading.Condition()
        self.running: tuple[str, int] | None = None
        self.streams = ActionStreams()
        self.state = ShellState.initial()
        self.started = time.time()
        self.freezer = Freezer()
        # Sessions of the actions started here: locally, the only processes the freezer touches.
        self.action_sessions: set[int] = set()

    # -- requests
    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "ping":
            return self.describe()
        if op == "set_generation":
            return self.set_generation(int(req["expected"]), int(req["new"]))
        if op == "fork":
            return self.fork(int(req["expected"]), int(req["new"]), str(req["trajectory"]))
        if op in ("submit", "wait"):
            return self.submit_or_wait(req, start=(op == "submit"))
        if op == "freeze":
            return self.freeze()
        if op == "quiesce":
            return self.quiesce()
        if op == "install":
            return self.install(str(req["path"]), req.get("archive"), str(req["owner"]))
        if op == "collect":
            return self.collect(str(req["path"]), int(req["max_bytes"]))
        if op == "record":
            return self.record(str(req["trajectory"]), int(req["step"]), req["observation"])
        raise RequestError("BadRequest", f"unknown op {op!r}")

    def install(self, path: str, archive: str | None, owner: str) -> dict:
        """Replace `path` by a fresh directory of `owner`'s ("agent" or "verifier") holding the
        files of `archive` (a tar the host put in the channel directory, removed here), or
        empty: how a task's tests reach /tests at verify time and its logs directory starts
        empty, whatever the agent left there. Done here, by PID 1 from the trusted toolchain,
        not by the image's tar or rm, which the agent can replace."""
        uid, gid = (VERIFIER_UID, VERIFIER_GID) if owner == "verifier" else (AGENT_UID, AGENT_GID)
        source = None
        if archive is not None:
            if "/" in archive or archive.startswith("."):
                raise RequestError("BadRequest", f"archive {archive!r} must be a file name in the channel directory")
            source = os.path.join(CHANNEL_DIR, archive)
        with self.lock:
            try:
                files = install_tree(path, source, uid, gid)
            except (OSError, ValueError) as exc:
                raise RequestError("InstallFailed", f"could not install {path}: {exc}") from None
            finally:
                if source is not None:
                    with_errors_ignored(os.unlink, source)
        return {"ok": True, "files": files}

    def record(self, trajectory: str, step: int, observation: dict) -> dict:
        """Journal `observation` as step `step`'s, over what ran there: a multi-step task's
        boundary, whose check ran as that step but whose logged observation is what the
        agent was told (the next step's instruction). A restore compares the journal with the
        trajectory's log, and a replay answers from it: both must see the logged one."""
        with self.lock:
            if self.running is not None:
                raise RequestError("Busy", f"action {self.running} is running")
            self.journal.append({"type": "action", "trajectory": trajectory, "step": step,
                                 "generation": self.journal.generation, "observation": observation})
        return {"ok": True}

    def collect(self, path: str, max_bytes: int) -> dict:
        """The regular files directly in `path` (a verifier's /logs/verifier, an artifact
        directory), or `path` itself when it is a regular file, base64, at most `max_bytes`
        of each; symbolic links and anything else are skipped, never followed (the agent may
        have planted one to make PID 1 read the journal)."""
        files: dict[str, str] = {}
        skipped: list[str] = []
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except NotADirectoryError:
            return self._collect_file(path, max_bytes)
        except OSError as exc:
            return {"ok": True, "files": files, "skipped": skipped, "missing": f"{path}: {exc.strerror}"}
        try:
            for name in sorted(os.listdir(fd)):
                try:
                    file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
                except OSError:
                    skipped.append(name)
                    continue
                try:
                    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
                        skipped.append(name)
                        continue
                    files[name] = base64.b64encode(os.read(file_fd, max_bytes)).decode()
                finally:
                    os.close(file_fd)
        finally:
            os.close(fd)
        return {"ok": True, "files": files, "skipped": skipped, "missing": None, "directory": True}

    @staticmethod
    def _collect_file(path: str, max_bytes: int) -> dict:
        name = os.path.basename(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            return {"ok": True, "files": {}, "skipped": [name], "missing": f"{path}: {exc.strerror}"}
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {"ok": True, "files": {}, "skipped": [name], "missing": None}
            return {"ok": True, "files": {name: base64.b64encode(os.read(fd, max_bytes)).decode()},
                    "skipped": [], "missing": None, "directory": False}
        finally:
            os.close(fd)

    def describe(self) -> dict:
        with self.lock:
            return {
                "ok": True,
                "version": VERSION,
                "generation": self.journal.generation,
                "trajectory": self.journal.trajectory,
                "head": self.journal.head(None),
                "busy": self.running is not None,
                "frozen": len(self.freezer.frozen),
                "running": list(self.running) if self.running else None,
                "actions": len(self.journal.entries),
            }

    def freeze(self) -> dict:
        """Stop every process of the agent's until its next action (the host hashes the
        workspace after this: nothing may change it while it is read)."""
        with self.lock:
            if self.running is not None:
                raise RequestError("Busy", f"action {self.running} is running")
            try:
                frozen = self.freezer.freeze(self.action_sessions)
            except FreezeFailed as exc:
                raise RequestError("FreezeFailed", str(exc)) from None
            return dict(self.describe(), frozen=frozen)

    def quiesce(self) -> dict:
        """What the host asks before a checkpoint: this sandbox's state, once every stopped
        process (the freezer's, and any the agent stopped itself) runs again. CRIU cannot
        seize a stopped task inside the frozen cgroup podman dumps from: it waits forever,
        holding the container's lock (cgroup v1, CRIU 4.2.1). The workspace hash freezes
        them again; what the agent had stopped itself stays resumed."""
        with self.lock:
            resumed = 0 if self.running is not None else self.freezer.resume_all(self.action_sessions)
            return dict(self.describe(), resumed=resumed)

    def set_generation(self, expected: int, new: int) -> dict:
        with self.lock:
            if self.journal.generation != expected:
                raise RequestError(
                    "StaleGeneration",
                    f"generation is {self.journal.generation}, not {expected}: another restore won",
                )
            if new <= expected:
                raise RequestError("BadRequest", f"new generation {new} must exceed {expected}")
            if self.running is not None:
                raise RequestError("Busy", f"action {self.running} is running")
            self.journal.append({"type": "generation", "generation": new, "at": time.time()})
            return self.describe()

    def fork(self, expected: int, new: int, trajectory: str) -> dict:
        """Become a fork serving `trajectory`: restored from another lineage's checkpoint,
        it takes the generation its own lineage gives it (any number: a new lineage) and
        the inherited steps as `trajectory`'s. Only once: a fork of a fork is a restore of
        the fork's own checkpoint, which carries its identity."""
        with self.lock:
            if self.journal.generation != expected:
                raise RequestError(
                    "StaleGeneration",
                    f"generation is {self.journal.generation}, not {expected}: another restore won",
                )
            if trajectory == SETUP_TRAJECTORY or not trajectory:
                raise RequestError("BadRequest", f"a fork serves a trajectory, not {trajectory!r}")
            if self.running is not None:
                raise RequestError("Busy", f"action {self.running} is running")
            self.journal.append({"type": "fork", "trajectory": trajectory, "generation": new, "at": time.time()})
            return self.describe()

    def submit_or_wait(self, req: dict, start: bool) -> dict:
        trajectory = str(req["trajectory"])
        step = int(req["step"])
        generation = int(req["generation"])
        key = (trajectory, step)
        with self.lock:
            if generation != self.journal.generation:
                raise RequestError(
                    "StaleGeneration",
                    f"action ({trajectory}, {step}) carries generation {generation}; this "
                    f"sandbox is at generation {self.journal.generation}",
                )
            if key in self.journal.entries:
                return {"ok": True, "state": "done", "replayed": True, "observation": self.journal.entries[key]}
            if self.running == key:
                pass  # a retry of the action in flight: wait for it below
            elif not start:
                raise RequestError("NotFound", f"action ({trajectory}, {step}) was never submitted")
            elif self.running is not None:
                raise RequestError("Busy", f"action {self.running} is still running")
            else:
                self._check_order(trajectory, step)
                command = str(req["command"]).encode("utf-8", "surrogateescape")
                timeout = float(req.get("timeout_s", 60.0))
                cap = int(req.get("output_cap", 65536))
                isolated = bool(req.get("isolated", False))
                processes = str(req.get("processes", "frozen"))
                if processes not in ("frozen", "running"):
                    raise RequestError("BadRequest", f"processes must be 'frozen' or 'running', not {processes!r}")
                runner = threading.Thread(
                    target=self._run_action, args=(key, generation, command, timeout, cap, isolated, processes),
                    daemon=True,
                )
                try:
                    runner.start()
                    self.running = key
                except RuntimeError as exc:
                    # The sandbox is out of pids (e.g. a background fork bomb): the agent's
                    # own doing, so it is the action's observation, journaled like any other.
                    obs = self._failed_observation(process_limit_note("the action could not start", exc))
                    self.journal.append({"type": "action", "trajectory": key[0], "step": key[1],
                                         "generation": generation, "observation": obs})  # fmt: skip
            wait_s = min(float(req.get("wait_s", 0.0)), MAX_WAIT_S)
            deadline = time.monotonic() + wait_s
            while key not in self.journal.entries:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ok": True, "state": "running"}
                self.lock.wait(left)
            return {"ok": True, "state": "done", "replayed": False, "observation": self.journal.entries[key]}

    def _check_order(self, trajectory: str, step: int) -> None:
        if trajectory != SETUP_TRAJECTORY:
            if self.journal.trajectory not in (None, trajectory):
                raise RequestError(
                    "BadRequest",
                    f"this sandbox belongs to trajectory {self.journal.trajectory!r}, not {trajectory!r}",
                )
            head = self.journal.head(trajectory)
            if step <= head:
                raise RequestError(
                    "OutOfOrder", f"step {step} is not after the journal head {head} and was never run here"
                )

    # -- one action
    def _run_action(self, key, generation, command, timeout, cap, isolated, processes) -> None:
        try:
            obs = self._execute(command, timeout, cap, isolated, processes)
        except (RuntimeError, BlockingIOError) as exc:  # no thread / fork: EAGAIN
            obs = self._failed_observation(process_limit_note("the action could not run", exc))
        except Exception as exc:  # the journal must still close the action
            obs = self._failed_observation(f"supervisor error: {type(exc).__name__}: {exc}")
        with self.lock:
            try:
                self.journal.append(
                    {"type": "action", "trajectory": key[0], "step": key[1], "generation": generation,
                     "observation": obs}
                )
            except OSError as exc:  # still answer the caller; the id is kept in memory
                obs = dict(obs, note=(obs.get("note", "") + f"; journal write failed: {exc}").lstrip("; "))
                self.journal._apply({"type": "action", "trajectory": key[0], "step": key[1], "observation": obs})
            finally:
                self.running = None
                self.lock.notify_all()

    @staticmethod
    def _failed_observation(note: str) -> dict:
        empty = {"b64": "", "total": 0, "dropped": 0}
        return {"exit_code": -1, "sha256": observation_hash(-1, "", "", False),
                "stdout": empty, "stderr": empty, "duration_s": 0.0,
                "timed_out": False, "shell_respawned": False, "note": note}

    def _execute(self, command: bytes, timeout: float, cap: int, isolated: bool, processes: str) -> dict:
        """Run one action in its own bash and report what this process saw, not what bash said.

        `isolated` (the reward check): the process starts from the verifier's environment
        in /workspace and hands nothing on; the agent's state stays as it was. With
        `processes="frozen"` every process the agent left is stopped first and stays
        stopped (through the workspace hash) until the agent's next action resumes it.
        """
        if not isolated:
            self.freezer.thaw()
            return self._execute_as(command, timeout, cap, self.state, isolated=False)
        if processes == "frozen":
            try:
                self.freezer.freeze(self.action_sessions)
            except FreezeFailed as exc:
                return self._failed_observation(f"the check did not run: {exc}")
        try:
            verifier = VerifierDirs()
        except OSError as exc:  # /tmp exhausted by the agent: its doing, the check fails
            return self._failed_observation(f"the check did not run: no room for its HOME and TMPDIR in /tmp: {exc}")
        try:
            state = ShellState(_verifier_environment(verifier.home, verifier.tmp), [], _workspace_dir())
            return self._execute_as(command, timeout, cap, state, isolated=True)
        finally:
            verifier.remove()

    def _execute_as(self, command: bytes, timeout: float, cap: int, state: ShellState, *, isolated: bool) -> dict:
        nonce = secrets.token_hex(8)
        out, err = Capture(nonce, cap), Capture(nonce, cap)
        before = list_processes()
        self.streams.attach(out, err)
        t0 = time.monotonic()
        try:
            user = (VERIFIER_UID, VERIFIER_GID) if isolated else (AGENT_UID, AGENT_GID)
            pid, dump_fd = spawn_action(command, state, self.streams, user)
            self.reaper.child_started.set()
            self.action_sessions.add(pid)
        except OSError as exc:
            self.streams.attach(None, None)
            if exc.errno == errno.EAGAIN:  # fork refused: the pids limit, not a broken sandbox
                return self._failed_observation(process_limit_note("the action's shell could not start", exc))
            return self._failed_observation(f"the action's shell could not start: {exc}")
        status, timed_out, notes = self._await_action(pid, before, timeout)
        duration = time.monotonic() - t0
        self.streams.close_action(nonce)
        out.done.wait(5.0)
        err.done.wait(5.0)
        self.streams.attach(None, None)
        dump = read_dump(dump_fd)
        state_lost = not isolated and not dump
        if state_lost:
            notes.append(
                "the action's shell ended without handing on its state (killed, or replaced by exec): the "
                "next action starts with the variables, functions and cwd of the action before"
            )
        elif not isolated:
            self.state, carried_notes = ShellState.from_dump(dump, self.state)
            notes.extend(carried_notes)
        exit_code = 124 if timed_out else _exit_code(status)
        stdout, stderr = out.finish(), err.finish()
        return {
            "exit_code": exit_code,
            "sha256": observation_hash(exit_code, stdout["b64"], stderr["b64"], timed_out),
            "stdout": stdout,
            "stderr": stderr,
            "duration_s": round(duration, 6),
            "timed_out": timed_out,
            "shell_respawned": state_lost,
            "note": "; ".join(notes),
        }

    def _await_action(self, pid: int, before: dict, timeout: float) -> tuple[int | None, bool, list[str]]:
        """Wait for the action's bash; on timeout kill what the action started, then bash itself
        if it does not finish (a builtin loop) -- its EXIT trap then cannot hand on state."""
        status = self.reaper.wait_for(pid, timeout)
        if status is not None:
            return status, False, []
        killed = self._kill_new_processes(before, session=pid, spare=pid)
        notes = [f"timed out after {timeout:g}s: killed {killed} process(es) the action started"]
        status = self.reaper.wait_for(pid, SHELL_GRACE_S)
        if status is None:
            _kill(pid)
            status = self.reaper.wait_for(pid, SHELL_GRACE_S)
            notes.append("the action's shell itself did not return and was killed")
        return status, True, notes

    def _kill_new_processes(self, before: dict, *, session: int, spare: int) -> int:
        """Kill every process the action started (but `spare`).

        Freeze first (SIGSTOP, repeated until a pass finds none of them still able to run:
        a stopped process cannot fork), then SIGKILL them all, so a fork bomb cannot refill
        the pids it frees. Signalled is not stopped: a process the SIGSTOP reached in the
        middle of a fork completes it, and its child is seen only by a later pass.
        """

        def started_by_the_action(pid: int, info: tuple) -> bool:
            if pid == spare or before.get(pid, (None,))[0] == info[0]:
                return False
            return not LOCAL or info[1] == session  # locally, only the action's own session

        signal_until_none(signal.SIGSTOP, lambda pid, info: started_by_the_action(pid, info) and may_run(pid))
        doomed = [
            pid for pid, info in list_processes().items()
            if pid not in (os.getpid(), 1) and started_by_the_action(pid, info) and not _exited(pid)
        ]  # fmt: skip
        for pid in doomed:  # all killed, settled or not: stopped ones too (the action's own)
            _kill(pid)
        _await_reaped(doomed, SHELL_GRACE_S)
        return len(doomed)


def _await_reaped(pids: list[int], timeout: float) -> None:
    """Until the killed processes are reaped (their parents or PID 1's reaper), at most
    `timeout`: a killed process holds its pid until then, and the next action, started
    at once, would find a fork bomb's pids still counted against the sandbox's limit."""
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _exit_code(status: int | None) -> int:
    """Exit status as a shell reports it: 128+N when killed by signal N; -1 when unknown."""
    if status is None:
        return -1
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


# ----------------------------------------------------------------------------- channel


def serve(sup: Supervisor, path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    srv.listen(16)
    log(f"listening on {path}")
    while True:
        try:
            conn, _ = srv.accept()
        except InterruptedError:
            continue
        except OSError as exc:  # out of fds or memory: the channel must stay up
            log(f"accept: {exc}")
            time.sleep(0.1)
            continue
        try:
            threading.Thread(target=_serve_one, args=(sup, conn), daemon=True).start()
        except RuntimeError:  # no thread left (pids limit, e.g. a fork bomb): answer inline
            _serve_one(sup, conn)


def _serve_one(sup: Supervisor, conn: socket.socket) -> None:
    try:
        conn.settimeout(30)
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_REQUEST:
                raise RequestError("BadRequest", "request too large")
        try:
            reply = sup.handle(json.loads(data))
        except RequestError as exc:
            reply = {"ok": False, "error": {"type": exc.kind, "message": str(exc)}}
        except (KeyError, ValueError, TypeError) as exc:
            reply = {"ok": False, "error": {"type": "BadRequest", "message": f"{type(exc).__name__}: {exc}"}}
        except Exception as exc:  # never leave a request without an answer
            reply = {"ok": False, "error": {"type": "Internal", "message": f"{type(exc).__name__}: {exc}"}}
        conn.sendall(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
    except (OSError, RequestError):
        pass
    finally:
        conn.close()


def _set_oom_score_adj(value: int) -> None:
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError as exc:
        log(f"oom_score_adj {value}: {exc}")


def hand_over_directories() -> None:
    """At start: the journal to the guard, /workspace and /home/agent to the agent, and /run
    and /run/lock writable by every user as /tmp is (mode 1777: the agent's pid files,
    sockets and locks), as they were when the agent was root."""
    if not HAND_OVER:
        # podman starts PID 1 in the image's WORKDIR; it keeps none of the agent's directories
        # as its cwd (one remade below would be a deleted directory CRIU cannot restore).
        os.chdir("/")
    if not HAND_OVER and not os.path.isdir(WORKSPACE):  # a task image without its WORKDIR (Harbor's /app)
        os.makedirs(WORKSPACE, 0o755)
        os.chown(WORKSPACE, AGENT_UID, AGENT_GID)
    elif not HAND_OVER and os.stat(WORKSPACE).st_uid == UNMAPPED_UID:
        # A WORKDIR no build step created: podman made it, empty, as the host's root, whom
        # the sandbox's user namespace does not map (so not even CAP_CHOWN may give it away).
        # Made anew, it is the agent's, as Docker would make it.
        try:
            os.rmdir(WORKSPACE)
            os.mkdir(WORKSPACE, 0o755)
            os.chown(WORKSPACE, AGENT_UID, AGENT_GID)
        except OSError as exc:
            log(f"the workdir {WORKSPACE} stays the unmapped user's: {exc}")
    owners = [(JOURNAL_DIR, GUARD_UID, GUARD_UID)]
    owners += [(WORKSPACE, AGENT_UID, AGENT_GID), (AGENT_HOME, AGENT_UID, AGENT_GID)] if HAND_OVER else []
    for directory, owner, group in owners:
        if os.path.isdir(directory) and os.stat(directory).st_uid != owner:
            os.chown(directory, owner, group)
    for directory in RUN_DIRS:
        if os.path.isdir(directory) and os.stat(directory).st_mode & 0o7777 != 0o1777:
            os.chmod(directory, 0o1777)


def with_errors_ignored(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except OSError:
        pass


def install_tree(path: str, archive: str | None, uid: int, gid: int) -> int:
    """`path` made a fresh directory of uid:gid (mode 0755), with the regular files and
    directories of the tar `archive` in it; returns how many files. Every component of
    `path` the agent replaced by a symbolic link is removed first, so nothing is written
    through one; members that are links, devices, absolute or climb out are refused."""
    import shutil
    import tarfile

    if not path.startswith("/") or ".." in path.split("/"):
        raise ValueError("the path must be absolute, without '..'")
    parts = [p for p in path.split("/") if p]
    for depth in range(1, len(parts) + 1):
        current = "/" + "/".join(parts[:depth])
        if os.path.islink(current) or (depth < len(parts) and os.path.exists(current) and not os.path.isdir(current)):
            os.unlink(current)
        if depth < len(parts) and not os.path.exists(current):
            os.mkdir(current, 0o755)
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    os.mkdir(path, 0o755)
    _give(path, uid, gid)
    if archive is None:
        return 0
    count = 0
    with tarfile.open(archive, "r:") as tar:
        for member in tar:
            name = member.name
            while name.startswith("./"):
                name = name[2:]
            if name in ("", "."):
                continue
            if member.name.startswith("/") or ".." in name.split("/"):
                raise ValueError(f"tar member {member.name!r} is absolute or climbs out")
            target = os.path.join(path, name)
            if member.isdir():
                os.makedirs(target, 0o755, exist_ok=True)
                _give(target, uid, gid)
            elif member.isfile():
                os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, member.mode & 0o755 or 0o644)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(tar.extractfile(member), out)
                _give(target, uid, gid)
                count += 1
            else:
                raise ValueError(f"tar member {member.name!r} is not a regular file or directory")
    return count


def _give(path: str, uid: int, gid: int) -> None:
    """Hand a file to uid:gid (locally, running as the test's user, files stay its own)."""
    if not LOCAL:
        os.chown(path, uid, gid, follow_symlinks=False)


def _ignore_signal(signum, frame) -> None:
    """A signal the agent sent PID 1: nothing to do (the host ends sandboxes with SIGKILL)."""


def main() -> None:
    if sys.argv[1:2] == ["--interpreter"]:
        HELPER_INTERPRETER[:] = sys.argv[2:]
    elif not LOCAL:
        raise SystemExit("supervisor: PID 1 needs --interpreter COMMAND... (the toolchain's, for the helper)")
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if LOCAL:
        import ctypes

        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        signal.signal(signal.SIGINT, lambda *_: os._exit(0))
        # Orphans (background jobs of a dead shell) re-parent here, as they do to PID 1.
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    else:
        for signum in IGNORED_BY_PID1:  # a handler, not SIG_IGN: an exec resets it for the children
            signal.signal(signum, _ignore_signal)
        _set_oom_score_adj(PID1_OOM_SCORE_ADJ)
        hand_over_directories()
    reaper = Reaper()
    sup = Supervisor(reaper)
    threading.Thread(target=serve, args=(sup, os.path.join(CHANNEL_DIR, SOCKET_NAME)), daemon=True).start()
    reaper.run_forever()


if __name__ == "__main__":
    main()
