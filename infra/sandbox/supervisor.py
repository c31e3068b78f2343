#!/usr/bin/env python3
"""Belayer's in-sandbox supervisor: PID 1 of every sandbox container.

Baked into the base image at /opt/belayer/supervisor.py (infra/install/base-image.sh
copies infra/sandbox/ there), so that the image name and id -- which a checkpoint
restore needs -- are the same on every host. Python 3.11 standard library only: it
runs on the image's Debian python3, not in Belayer's virtual environment.

What lives here, and what must not:
* one persistent bash shell in which every action runs; cwd, exported variables,
  functions and background jobs persist between actions;
* per-action timeout: the processes the action started are killed; a shell that is
  itself stuck (a builtin loop) is replaced, its cwd and exported environment restored
  from the last completed action, and the observation says so;
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
  actions holds no connection (DESIGN.md s7). Long actions are submit -> poll ("wait"
  long-polls a few seconds). Why a socket and not a FIFO pair: each connection frames
  one request and its answer, so a worker that crashed mid-poll and its retry (or a
  ping during a long action) never read each other's replies, with no reply ids and no
  single-reader rule; the price -- no connection may be open at checkpoint time -- is
  paid by the host, which serialises checkpoint and exec per sandbox;

Who may touch what. Every process in the sandbox runs as uid/gid 0: CRIU on these
hosts lacks CAP_SYS_RESOURCE, and the kernel then lets it read the rlimits only of
processes whose uids and gids all equal its own (an agent running as uid 1000 made
every dump fail with "Can't get rlimit"). So the agent is root *without any
capability*: the shell is started through `--drop-caps-exec`, which clears its
effective, permitted and inheritable sets, and the container's no-new-privileges
keeps every later exec from regaining them. The journal (a tmpfs at
/var/lib/belayer) and the channel directory are owned by uid 999 with mode 0700:
a capability-less root is not their owner and cannot enter them; only PID 1 keeps
CAP_DAC_OVERRIDE (to reach them) and CAP_CHOWN (to hand the journal to 999 at
start). PID 1 marks itself non-dumpable, so the agent cannot ptrace it or open
/proc/1/fd or /proc/1/mem, and it installs no SIGTERM/SIGINT handler, so the kernel
drops those signals from inside the container (podman removes sandboxes with SIGKILL).
The root file system is read-only; everything writable is a size-limited tmpfs.

No host-side policy lives here (limits, checkpoints, storage): only what must run
inside the container. Local mode (BELAYER_SUPERVISOR_LOCAL=1) runs it as an ordinary
process for tests: no capability changes, and only the shell's session is ever killed.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

VERSION = 1
LOCAL = os.environ.get("BELAYER_SUPERVISOR_LOCAL") == "1"
CHANNEL_DIR = os.environ.get("BELAYER_CHANNEL_DIR", "/run/belayer")
JOURNAL_DIR = os.environ.get("BELAYER_JOURNAL_DIR", "/var/lib/belayer")
GUARD_UID = 999  # owner of the journal and channel: not the agent, not reachable by it
AGENT_HOME = os.environ.get("BELAYER_AGENT_HOME", "/home/agent")
WORKSPACE = os.environ.get("BELAYER_WORKSPACE", "/workspace")
SOCKET_NAME = "supervisor.sock"
MAX_REQUEST = 8 * 1024 * 1024
MAX_WAIT_S = 5.0
# After a timeout kill, how long the shell gets to report the killed command's status
# before it is considered stuck itself and replaced.
SHELL_GRACE_S = 2.0
SETUP_TRAJECTORY = "__setup__"
KEEP_FULL_OBSERVATIONS = 32

# The shell's program. {OUT} {ERR} {ST} are the inherited pipe fds; they are moved to
# 3/4/5. Each action arrives on stdin as a header line "<nonce> <nbytes>" followed by
# exactly nbytes of command text (read -N in the C locale counts bytes).
DRIVER = r"""
exec 3>&{OUT} 4>&{ERR} 5>&{ST} {OUT}>&- {ERR}>&- {ST}>&-
{RESTORE}
while IFS= read -r __belayer_hdr; do
  __belayer_nonce=${__belayer_hdr%% *}
  LC_ALL=C IFS= read -r -N "${__belayer_hdr#* }" __belayer_cmd
  eval "$__belayer_cmd" </dev/null >&3 2>&4 3>&- 4>&- 5>&-
  __belayer_rc=$?
  printf '\036%s\036' "$__belayer_nonce" >&3
  printf '\036%s\036' "$__belayer_nonce" >&4
  __belayer_state=$(export -p; printf 'cd -- %q 2>/dev/null\n' "$PWD")
  LC_ALL=C printf '%s %s %s\n%s' "$__belayer_nonce" "$__belayer_rc" "${#__belayer_state}" "$__belayer_state" >&5
done
"""


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


class StatusReader(threading.Thread):
    """Reads "<nonce> <rc> <len>\\n<state>" records the shell writes after each action."""

    def __init__(self, fd: int):
        super().__init__(name="status", daemon=True)
        self.fd = fd
        self.cond = threading.Condition()
        self.results: dict[str, tuple[int, str]] = {}
        self.eof = False

    def run(self) -> None:
        buf = b""
        while True:
            try:
                data = os.read(self.fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                with self.cond:
                    self.eof = True
                    self.cond.notify_all()
                os.close(self.fd)
                return
            buf += data
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                parts = buf[:nl].split(b" ")
                if len(parts) != 3:
                    buf = buf[nl + 1 :]
                    continue
                need = int(parts[2])
                if len(buf) - nl - 1 < need:
                    break
                state = buf[nl + 1 : nl + 1 + need].decode("utf-8", "surrogateescape")
                buf = buf[nl + 1 + need :]
                with self.cond:
                    self.results[parts[0].decode()] = (int(parts[1]), state)
                    self.cond.notify_all()

    def wait_for(self, nonce: str, timeout: float) -> tuple[int, str] | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while nonce not in self.results and not self.eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.results.pop(nonce, None)


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


def _shell_stderr():
    """Where the driver's own errors go: nowhere, or BELAYER_SHELL_STDERR (a file, for debugging)."""
    path = os.environ.get("BELAYER_SHELL_STDERR")
    return open(path, "ab") if path else subprocess.DEVNULL  # noqa: SIM115 (inherited by the shell)


def _high_fd(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)
    os.close(fd)
    return high


class Shell:
    """The persistent bash and its pipes. Replaced (respawn) when it dies or is stuck."""

    def __init__(self, restore_script: str, reaper: Reaper):
        self.reaper = reaper
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        # The shell moves these to 3/4/5: they must not be numbered 3..5 themselves.
        out_w, err_w, st_w = (_high_fd(fd) for fd in (out_w, err_w, st_w))
        cmd_r, cmd_w = os.pipe()
        program = (
            DRIVER.replace("{OUT}", str(out_w))
            .replace("{ERR}", str(err_w))
            .replace("{ST}", str(st_w))
            .replace("{RESTORE}", restore_script)
        )
        env = self._environment()
        argv = ["/bin/bash", "--noprofile", "--norc", "-c", program]
        if not LOCAL:
            argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--drop-caps-exec", *argv]
        cwd = WORKSPACE if os.path.isdir(WORKSPACE) else "/"
        proc = subprocess.Popen(
            argv,
            stdin=cmd_r,
            stdout=subprocess.DEVNULL,
            stderr=_shell_stderr(),
            pass_fds=(out_w, err_w, st_w),
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        self.pid = proc.pid
        # The reaper owns the exit status; Popen must never wait on this pid.
        proc.returncode = 0
        for fd in (out_w, err_w, st_w, cmd_r):
            os.close(fd)
        self.cmd_w = cmd_w
        self.out = StreamReader(out_r, "stdout")
        self.err = StreamReader(err_r, "stderr")
        self.status = StatusReader(st_r)
        for t in (self.out, self.err, self.status):
            t.start()
        self.last_state = restore_script

    @staticmethod
    def _environment() -> dict[str, str]:
        if LOCAL:
            env = dict(os.environ)
            for k in list(env):
                if k.startswith("BELAYER_"):
                    del env[k]
            return env
        return {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": AGENT_HOME,
            "USER": "root",
            "LOGNAME": "root",
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def alive(self) -> bool:
        return self.reaper.status_of(self.pid) is None

    def send(self, nonce: str, command: bytes) -> None:
        os.write(self.cmd_w, f"{nonce} {len(command)}\n".encode())
        view = memoryview(command)
        while view:
            n = os.write(self.cmd_w, view)
            view = view[n:]

    def kill(self) -> None:
        """Kill the shell (its background jobs survive: they may be the agent's servers)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.close(self.cmd_w)
        except OSError:
            pass


class Reaper:
    """PID 1 duty: reap every child, orphans included; keep the shells' exit statuses."""

    def __init__(self):
        self.lock = threading.Lock()
        self.statuses: dict[int, int] = {}

    def run_forever(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.2)
                continue
            except InterruptedError:
                continue
            with self.lock:
                self.statuses[pid] = status
                if len(self.statuses) > 4096:
                    for k in list(self.statuses)[:2048]:
                        del self.statuses[k]

    def status_of(self, pid: int) -> int | None:
        with self.lock:
            return self.statuses.get(pid)


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
        self.shell = Shell("", reaper)
        self.last_state = ""
        self.started = time.time()

    # -- requests
    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "ping":
            return self.describe()
        if op == "set_generation":
            return self.set_generation(int(req["expected"]), int(req["new"]))
        if op in ("submit", "wait"):
            return self.submit_or_wait(req, start=(op == "submit"))
        raise RequestError("BadRequest", f"unknown op {op!r}")

    def describe(self) -> dict:
        with self.lock:
            return {
                "ok": True,
                "version": VERSION,
                "generation": self.journal.generation,
                "trajectory": self.journal.trajectory,
                "head": self.journal.head(None),
                "busy": self.running is not None,
                "running": list(self.running) if self.running else None,
                "actions": len(self.journal.entries),
                "shell_pid": self.shell.pid,
            }

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
                runner = threading.Thread(
                    target=self._run_action, args=(key, generation, command, timeout, cap), daemon=True
                )
                try:
                    runner.start()
                    self.running = key
                except RuntimeError as exc:
                    # The sandbox is out of pids (e.g. a background fork bomb): the agent's
                    # own doing, so it is the action's observation, journaled like any other.
                    obs = self._failed_observation(
                        f"the action could not start: {exc}; the sandbox's process limit is exhausted "
                        f"({len(list_processes())} processes): kill some, or recover the sandbox"
                    )
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
    def _run_action(self, key, generation, command, timeout, cap) -> None:
        try:
            obs = self._execute(command, timeout, cap)
        except (RuntimeError, BlockingIOError) as exc:  # no thread / fork: EAGAIN
            obs = self._failed_observation(
                f"the action could not run: {exc}; the sandbox's process limit is exhausted "
                f"({len(list_processes())} processes): kill some, or recover the sandbox"
            )
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

    def _execute(self, command: bytes, timeout: float, cap: int) -> dict:
        notes = []
        respawned = False
        if not self.shell.alive():
            self._respawn()
            respawned = True
            notes.append(self._respawn_note("the shell had exited"))
        shell = self.shell
        nonce = secrets.token_hex(8)
        out, err = Capture(nonce, cap), Capture(nonce, cap)
        before = list_processes()
        shell.out.attach(out)
        shell.err.attach(err)
        t0 = time.monotonic()
        exit_code: int | None = None
        timed_out = False
        try:
            shell.send(nonce, command)
        except OSError:
            pass
        result = self._await_status(shell, nonce, timeout)
        if result is None and shell.alive() and not shell.status.eof:
            timed_out = True
            killed = self._kill_new_processes(shell, before)
            notes.append(f"timed out after {timeout:g}s: killed {killed} process(es) the action started")
            result = self._await_status(shell, nonce, SHELL_GRACE_S)
            if result is None:
                shell.kill()
                self._respawn()
                respawned = True
                notes.append(self._respawn_note("the shell itself did not return"))
        duration = time.monotonic() - t0
        if result is not None:
            exit_code, self.last_state = result
            out.done.wait(5.0)
            err.done.wait(5.0)
        elif not timed_out:
            st = self.reaper.status_of(shell.pid)
            code = os.waitstatus_to_exitcode(st) if st is not None else None
            exit_code = code if code is not None else -1
            self._respawn()
            respawned = True
            notes.append(self._respawn_note(f"the action ended the shell (status {code})"))
        if exit_code is None:
            exit_code = 124 if timed_out else -1
        shell.out.attach(None)
        shell.err.attach(None)
        stdout, stderr = out.finish(), err.finish()
        return {
            "exit_code": exit_code,
            "sha256": observation_hash(exit_code, stdout["b64"], stderr["b64"], timed_out),
            "stdout": stdout,
            "stderr": stderr,
            "duration_s": round(duration, 6),
            "timed_out": timed_out,
            "shell_respawned": respawned,
            "note": "; ".join(notes),
        }

    def _await_status(self, shell: Shell, nonce: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            got = shell.status.wait_for(nonce, min(left, 0.5))
            if got is not None:
                return got
            if shell.status.eof or not shell.alive():
                got = shell.status.wait_for(nonce, 0.05)
                # The shell is gone: give the reaper a moment to record its status.
                for _ in range(100):
                    if got is not None or not shell.alive():
                        break
                    time.sleep(0.01)
                return got

    def _kill_new_processes(self, shell: Shell, before: dict) -> int:
        """Kill every process the action started.

        Freeze first (SIGSTOP, repeated until a pass finds nothing new: a stopped process
        cannot fork), then SIGKILL them all, so a fork bomb cannot refill the pids it frees.
        """
        me = os.getpid()
        frozen: set[int] = set()
        for _ in range(200):
            fresh = []
            for pid, info in list_processes().items():
                if pid in (me, shell.pid, 1) or pid in frozen or before.get(pid, (None,))[0] == info[0]:
                    continue
                if LOCAL and info[1] != shell.pid:
                    continue  # locally, only the shell's own session
                fresh.append(pid)
            if not fresh:
                break
            for pid in fresh:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    frozen.add(pid)
                except OSError:
                    pass
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return len(frozen)

    def _respawn(self) -> None:
        self.shell = Shell(self.last_state, self.reaper)

    @staticmethod
    def _respawn_note(why: str) -> str:
        return (
            f"{why}; a new shell was started with the cwd and exported variables of the last "
            "completed action (unexported variables, functions and the job table are lost; "
            "background processes keep running)"
        )


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


def drop_caps_exec(argv: list[str]) -> None:
    """Clear this process's capability sets, then exec argv (the agent's shell)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise SystemExit(f"capset failed: errno {ctypes.get_errno()}")
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    os.execv(argv[0], argv)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--drop-caps-exec":
        drop_caps_exec(sys.argv[2:])
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if LOCAL:
        import ctypes

        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        signal.signal(signal.SIGINT, lambda *_: os._exit(0))
        # Orphans (background jobs of a dead shell) re-parent here, as they do to PID 1.
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    else:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, no /proc/1/fd
        if os.path.isdir(JOURNAL_DIR) and os.stat(JOURNAL_DIR).st_uid != GUARD_UID:
            os.chown(JOURNAL_DIR, GUARD_UID, GUARD_UID)
    reaper = Reaper()
    sup = Supervisor(reaper)
    threading.Thread(target=serve, args=(sup, os.path.join(CHANNEL_DIR, SOCKET_NAME)), daemon=True).start()
    reaper.run_forever()


if __name__ == "__main__":
    main()
