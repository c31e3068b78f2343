"""`priority.at_niceness`: the work and what it starts run lower; the caller does not."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from belayer.sandbox import priority


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_work_and_its_subprocesses_run_raised_and_the_caller_is_unchanged():
    before = _own_nice()
    inside, child = priority.at_niceness(
        5,
        lambda: (
            _own_nice(),
            int(subprocess.run(["nice"], capture_output=True, text=True, check=True).stdout),
        ),
    )
    assert inside == child == min(19, before + 5)
    assert _own_nice() == before


def test_zero_runs_on_the_calling_thread():
    assert priority.at_niceness(0, threading.get_native_id) == threading.get_native_id()


def test_an_error_reaches_the_caller():
    with pytest.raises(ZeroDivisionError):
        priority.at_niceness(3, lambda: 1 / 0)
