"""A test run that is terminated (SIGTERM) still stops the services it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from belayer.stack.process import PidRecord

REPO_ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import os, time
from pathlib import Path

def test_waits_to_be_terminated(seaweedfs):
    proc = seaweedfs.process.running()
    Path(os.environ["PROBE_PID_FILE"]).write_text(str(proc.pid))
    time.sleep(120)
"""


@pytest.mark.usefixtures("local_processes")
def test_a_terminated_run_stops_the_services_it_started(tmp_path):
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (probe_dir / "test_probe.py").write_text(PROBE)
    pid_file = tmp_path / "seaweedfs.pid"
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(probe_dir),
         str(probe_dir / "test_probe.py")],
        cwd=REPO_ROOT, env={**os.environ, "PROBE_PID_FILE": str(pid_file), "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            assert run.poll() is None, run.stdout.read().decode()
            assert time.monotonic() < deadline, "the probe run never started SeaweedFS"
            time.sleep(0.2)
        proc = psutil.Process(int(pid_file.read_text()))
        server = PidRecord(proc.pid, proc.cmdline(), proc.create_time())

        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=60)[0].decode()
    finally:
        if run.poll() is None:
            run.kill()
    survivor = server.process()  # None once exited (or the pid names another process)
    if survivor is not None:
        survivor.kill()  # this test's own failure leaves nothing behind either
    assert survivor is None, f"SeaweedFS (pid {server.pid}) outlived the terminated run:\n{output}"
    assert run.returncode == pytest.ExitCode.INTERRUPTED, output
