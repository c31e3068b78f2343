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
import pytest

@pytest.fixture
def slow_to_stop(seaweedfs):
    yield seaweedfs
    time.sleep(float(os.environ["PROBE_TEARDOWN_S"]))  # a stack going down takes a while

def test_waits_to_be_terminated(seaweedfs, slow_to_stop):
    proc = seaweedfs.process.running()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(os.environ["PROBE_PID_DIR"], worker).write_text(str(proc.pid))
    time.sleep(120)
"""
# A parallel run gets two probe modules (one work unit each), so both workers hold a server,
# and teardowns longer than xdist waits for a worker to exit (10 s).
RUNS = {"serial": ([], 1, 1), "parallel": (["-n", "2", "--dist", "loadgroup"], 2, 12)}


@pytest.mark.usefixtures("local_processes")
@pytest.mark.parametrize("mode", RUNS)
def test_a_terminated_run_stops_the_services_it_started(tmp_path, mode):
    """Also in a parallel run, where the workers hold the services and SIGTERM reaches only
    the controller (`timeout`, a CI job's limit)."""
    options, servers, teardown_s = RUNS[mode]
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    for k in range(servers):
        (probe_dir / f"test_probe_{k}.py").write_text(PROBE)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, "--rootdir", str(probe_dir),
         str(probe_dir)],
        cwd=REPO_ROOT, env={**os.environ, "PROBE_PID_DIR": str(pid_dir), "PYTHONPATH": str(REPO_ROOT),
             "PROBE_TEARDOWN_S": str(teardown_s)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while len(list(pid_dir.iterdir())) < servers:
            assert run.poll() is None, run.stdout.read().decode()
            assert time.monotonic() < deadline, "the probe run never started its SeaweedFS servers"
            time.sleep(0.2)
        procs = [psutil.Process(int(f.read_text())) for f in pid_dir.iterdir()]
        started = [PidRecord(proc.pid, proc.cmdline(), proc.create_time()) for proc in procs]

        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=120)[0].decode()
    finally:
        if run.poll() is None:
            run.kill()
    survivors = [s for s in (server.process() for server in started) if s is not None]  # None once exited
    for survivor in survivors:
        survivor.kill()  # this test's own failure leaves nothing behind either
    assert not survivors, f"SeaweedFS {[s.pid for s in survivors]} outlived the terminated run:\n{output}"
    assert run.returncode == pytest.ExitCode.INTERRUPTED, output
