"""Nothing left behind on the whole stack (`belayer up`): a trajectory terminated from Temporal
ends `belayer run` with a result that says so, and its host's reaper removes its sandbox,
which `belayer sandboxes` shows before and after."""

from __future__ import annotations

import asyncio
import json
import time

from belayer.temporal_client import connect
from tests.test_sandbox_hosts import run, until_running_trajectories
from tests.test_stack import belayer

# Long enough to be terminated mid-way.
WORKLOAD = """\
tasks:
  - id: lifecycle
    setup: ["mkdir -p /workspace/w"]
    turns:
""" + "".join(
    f'      - {{think_tokens: 8, bash: "sleep 2; echo {i} >> /workspace/w/log"}}\n' for i in range(12)
)

REAP_WITHIN_S = 90  # sandbox.reap_interval_s (20 s) with room for a loaded machine: a bound, not a figure


def listed(env) -> dict[str, dict]:
    return {s["sandbox_id"]: s for s in json.loads(belayer(env, "sandboxes", "--json").stdout)["sandboxes"]}


async def terminate(config, workflow_id: str) -> None:
    client = await connect(config.temporal, config.storage.encryption_key)
    await client.get_workflow_handle(workflow_id).terminate("stopped from the web UI")


def test_a_terminated_trajectory_is_reported_and_its_sandbox_reaped(stack, tmp_path):
    config, env = stack
    workload = tmp_path / "lifecycle.yaml"
    workload.write_text(WORKLOAD)
    running = run(env, workload, background=True)
    asyncio.run(until_running_trajectories(config, running, lambda seen: any(p.step >= 1 for p in seen),
                                           "a step taken"))  # fmt: skip
    ours = {sid: s for sid, s in listed(env).items() if (s["trajectory"] or "").startswith("lifecycle-")}
    ((sandbox_id, before),) = ours.items()
    assert (
        before["workflow_status"] == "RUNNING" and before["state"] == "running" and before["memory_bytes"] > 0
    )

    staging = json.loads(belayer(env, "sandboxes", "--json").stdout)["staging"]
    assert [(h["host"], h["budget_bytes"]) for h in staging] == [
        (before["host"], config.sandbox.staging_budget_mb << 20)
    ], staging

    asyncio.run(terminate(config, before["trajectory"]))
    out, err = running.communicate(timeout=120)
    assert running.returncode == 1, out + err  # a trajectory that did not complete, and no traceback
    (result,) = json.loads(out)["trajectories"]
    assert result["status"] == "failed_infra" and result["reward"] is None
    assert "closed without a result" in result["reason"] and "terminated" in result["reason"].lower(), result

    deadline = time.monotonic() + REAP_WITHIN_S
    while sandbox_id in listed(env) and time.monotonic() < deadline:
        time.sleep(2)
    assert sandbox_id not in listed(env), "the reaper left the terminated trajectory's sandbox"
    log = (config.state_dir / "logs" / "sandbox-worker.log").read_text()
    assert f"reaped sandbox {sandbox_id}: its workflow {before['trajectory']} is terminated" in log
