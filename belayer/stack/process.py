"""Background processes that `belayer up` starts and `belayer down` stops.

Each process leaves a pid file (JSON: pid, argv, start time) in `<state>/run/`. A pid is
only ever signalled when the live process still has the recorded start time, so a
recycled pid belonging to someone else is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class PidRecord:
    """What we remember about a process we started."""

    pid: int
    argv: list[str]
    create_time: float

    def process(self) -> psutil.Process | None:
        """The live process, or None when it exited or the pid now names another one."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.5:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None


class ManagedProcess:
    """One named background process with its pid file and log file."""

    def __init__(self, name: str, state_dir: Path):
        self.name = name
        self.pid_file = state_dir / "run" / f"{name}.pid"
        self.log_file = state_dir / "logs" / f"{name}.log"

    def record(self) -> PidRecord | None:
        try:
            return PidRecord(**json.loads(self.pid_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def running(self) -> psutil.Process | None:
        record = self.record()
        return record.process() if record else None

    def start(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> int:
        """Start detached (own session, so a Ctrl-C on `up` does not reach it)."""
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        record = PidRecord(proc.pid, argv, psutil.Process(proc.pid).create_time())
        self.pid_file.write_text(json.dumps(asdict(record)))
        return proc.pid

    def stop(self, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> bool:
        """`sig` (SIGTERM), then SIGKILL after `timeout_s`; True when something was stopped."""
        proc = self.running()
        stopped = False
        if proc is not None:
            _terminate_group(proc, timeout_s, sig)
            stopped = True
        self.pid_file.unlink(missing_ok=True)
        return stopped

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _terminate_group(proc: psutil.Process, timeout_s: float, sig: int) -> None:
    """Stop the process and the children it started (they share its session)."""
    family = [proc, *proc.children(recursive=True)]
    for member in family:
        _signal(member, sig)
    _, alive = psutil.wait_procs(family, timeout=timeout_s)
    for member in alive:
        _signal(member, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


def reap_if_child(pid: int) -> None:
    """Collect a child that exited so it does not linger as a zombie of this process."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
