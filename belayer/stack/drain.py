"""`belayer drain HOST`: drain one sandbox host of the local stack and wait for its report.

The drain itself runs in the host's worker (belayer/workers/sandbox/worker.py), started
the way a platform starts it before taking the machine: SIGTERM. This side leaves the
deadline in the worker's request file first, follows the report the worker writes as it
goes, and returns it once the worker has exited.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

import psutil

from belayer.errors import StackError
from belayer.sandbox.drain import DrainReport
from belayer.stack.local import LocalStack
from belayer.workers.sandbox.worker import drain_files

# Past the deadline: the worker's last answers, its shutdown and the report's write.
EXIT_GRACE_S = 30.0


def drain_host(stack: LocalStack, name: str, deadline_s: float | None,
               progress: Callable[[DrainReport], None] = lambda _r: None) -> DrainReport:  # fmt: skip
    """SIGTERM the host's worker with `deadline_s` (default `sandbox.drain_deadline_s`) and
    wait until it has drained and exited; its report, sandbox by sandbox."""
    service = stack.sandbox_host(name)
    managed = stack.process(service)
    worker = managed.running()
    if worker is None:
        raise StackError(f"sandbox host {name} ({service.name}) is not running: there is nothing to drain")
    deadline_s = stack.config.sandbox.drain_deadline_s if deadline_s is None else deadline_s
    request, report_file = drain_files(stack.config, service.task_queue)
    report_file.unlink(missing_ok=True)
    request.parent.mkdir(parents=True, exist_ok=True)
    request.write_text(json.dumps({"deadline_s": deadline_s}))
    worker.send_signal(signal.SIGTERM)
    give_up = time.monotonic() + deadline_s + EXIT_GRACE_S
    seen = None
    while _alive(worker) and time.monotonic() < give_up:
        report = _read(report_file)
        if report is not None and report != seen:
            progress(report)
            seen = report
        time.sleep(0.3)
    if _alive(worker):
        managed.stop(sig=signal.SIGINT)
        raise StackError(f"sandbox host {name} did not finish draining within {deadline_s + EXIT_GRACE_S:.0f}s and "
                         f"was stopped; its log is {managed.log_file}")  # fmt: skip
    managed.stop()  # only forgets its pid: it has exited
    report = _read(report_file)
    if report is None:
        raise StackError(f"sandbox host {name} exited without a drain report (its deadline was 0, or it failed); "
                         f"its log is {managed.log_file}:\n{managed.log_tail()}")  # fmt: skip
    return report


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _read(report_file) -> DrainReport | None:
    try:
        return DrainReport.model_validate_json(report_file.read_text())
    except (OSError, ValueError):
        return None
