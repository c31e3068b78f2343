"""`belayer serve` as the stack runs it (`belayer up` starts the endpoint service) and
`belayer bench serve` as a user runs it, against the package's private whole stack: the
example agent reaches the endpoint, survives an engine crash during its call, and the
bench measures both servers. Nothing is judged on how long it took."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_stack import belayer, service_status

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent.py"


def test_the_example_agent_survives_an_engine_crash_through_the_stacks_endpoint(stack):
    config, env = stack
    endpoint = service_status(env)["endpoint"]
    assert endpoint["healthy"], endpoint
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", f"http://127.0.0.1:{config.stack.serve_port}/v1",
         "--crash-engine-at-call", "1", "--seed", "2", "--json"],
        env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    finished = json.loads(done.stdout)
    assert finished["status"] in ("completed", "failed_policy"), finished  # never failed_infra
    assert finished["crash_landed"].startswith("mid-call"), finished
    assert finished["prompt_tokens"] > 0 and finished["model_tokens"] > 0
    assert service_status(env)["rollout-node"]["healthy"]


def test_the_bench_measures_both_servers_and_splits_belayers_call(stack):
    done = belayer(stack[1], "bench", "serve", "--sessions", "1", "--calls", "3", "--json", timeout=900)
    report = json.loads(done.stdout)
    assert (report["conversations"], report["calls_per_side"]) == (1, 3)
    assert "conversation 1/1" in done.stderr
    belayer_call, vllm_call = report["call_ms"]["belayer"]["median"], report["call_ms"]["vllm"]["median"]
    assert belayer_call > 0 and vllm_call > 0
    assert report["overhead_ms_per_call"] == pytest.approx(belayer_call - vllm_call, abs=0.15)
    split = report["belayer_split_ms"]
    assert 0 < split["of_it_engine"]["median"] <= split["generate_activity"]["median"] < belayer_call
    assert split["around_it"]["min"] > 0, "the endpoint and Temporal cost something"
