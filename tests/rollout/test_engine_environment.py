"""An engine process's environment takes effect only if it is set before torch and vLLM load:
OpenMP reads OMP_WAIT_POLICY (and vLLM its logging level) once, at import
(belayer/rollout/procutil.py)."""

from __future__ import annotations

import subprocess
import sys

from belayer.rollout.procutil import engine_environment


def test_the_engine_entry_modules_load_neither_torch_nor_vllm(local_processes):
    """The spawn child imports these to find its target; were torch among their imports,
    the environment `engine_main` sets would come too late and its threads would spin."""
    probe = (
        "import sys, belayer.rollout.engine, belayer.bench.plain_engine; "
        "print(','.join(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == ""


def test_engine_threads_sleep_between_operations_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = engine_environment(0)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "OMP_NUM_THREADS" not in env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert engine_environment(2)["OMP_WAIT_POLICY"] == "ACTIVE"
    assert engine_environment(2)["OMP_NUM_THREADS"] == "2"
