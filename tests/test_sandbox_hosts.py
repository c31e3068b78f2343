"""Two sandbox hosts and two rollout nodes on one machine, really separate where recovery
cares: a rollout node lost mid-run and the trajectory's turns finished on the other node;
a whole sandbox host lost mid-trajectory (its worker, podman, containers killed, its
storage wiped) and the trajectory finished on the other host from the object store; each
with the tokens and the workspace of the run without a fault. The lost ones come back
with `belayer up` (the host empty), and nothing is left running after `down`."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from belayer.stack import sandbox_hosts
from belayer.stack.process import ManagedProcess
from tests.test_stack import BELAYER, belayer, service_status, whole_stack

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.engine]
WORKLOAD = """\
tasks:
  - id: two-hosts
    setup:
      - mkdir -p /workspace/w
    turns:
      - {think_tokens: 16, bash: "cd /workspace/w && export STAGE=one && echo $STAGE > stage.txt"}
      - {think_tokens: 16, bash: "seq 1 200 > n.txt && wc -l < n.txt"}
      - {think_tokens: 16, bash: "sha256sum n.txt > n.sum && cat n.sum"}
      - {think_tokens: 16, bash: "export STAGE=two && echo $STAGE >> stage.txt && cat stage.txt"}
      - {think_tokens: 16, bash: "awk '{ s += $1 } END { print s }' n.txt > total.txt && cat total.txt"}
      - {think_tokens: 16, bash: "ls -1 | sort && echo $STAGE"}
"""


@pytest.fixture
def two_hosts():
    """A whole private stack with two sandbox hosts and two rollout nodes; a process of
    the second host left after `down` is a leak too."""
    with whole_stack("blh-", {"BELAYER_ROLLOUT__NODE_ID": f"t{uuid.uuid4().hex[:6]}",
                              "BELAYER_POLICY__MODE": "every-step"}, "--sandbox-hosts", "2", "--rollout-nodes", "2",
                     also_leaked=lambda config: [p.pid for p in sandbox_hosts.processes(config, 1)]) as started:
        yield started


def run(env, workload: Path, *args: str, background: bool = False):
    argv = [*BELAYER, "run", str(workload), "--json", *args]
    if background:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_a_lost_node_and_a_lost_host_are_each_recovered_on_the_other(two_hosts, tmp_path):
    config, env = two_hosts
    second = f"{socket.gethostname()}-h1"
    status = service_status(env)
    assert status["sandbox-worker"]["healthy"] and status["sandbox-worker.1"]["healthy"]
    assert f"polling belayer-sandbox-{second} as belayer-sandbox@{second}:" in status["sandbox-worker.1"]["detail"]
    workload = tmp_path / "two-hosts.yaml"
    workload.write_text(WORKLOAD)
    clean = run(env, workload)["trajectories"][0]
    assert clean["status"] == "completed" and not clean["recoveries"]

    # The node serving the trajectory is lost: its turns finish on the other node.
    node_lost = run(env, workload, "--chaos", "node-crash@step=2")
    (fault,) = node_lost["faults"]
    assert fault["target"].startswith("rollout-node") and fault["detail"].endswith("left down"), fault
    result = node_lost["trajectories"][0]
    assert result["status"] == "completed"
    assert (result["token_sha256"], result["env_sha256"]) == (clean["token_sha256"], clean["env_sha256"])
    lost_node = fault["target"].split()[0]
    assert not service_status(env)[lost_node]["healthy"]
    belayer(env, "up")
    assert service_status(env)[lost_node]["healthy"]

    # Only the second host serves while the run starts: the trajectory's sandbox lives there.
    ManagedProcess("sandbox-worker", config.state_dir).stop()
    faulted = run(env, workload, "--chaos", "sandbox-host-crash@step=3", background=True)
    lost = ManagedProcess("sandbox-worker.1", config.state_dir)
    while (lost.running() is not None or sandbox_hosts.host_dir(config, 1).exists()) and faulted.poll() is None:
        time.sleep(0.5)
    assert faulted.poll() is None, "the run ended before its host was lost"
    belayer(env, "up", "--only", "sandbox-worker")  # the host that takes over
    out, err = faulted.communicate(timeout=600)
    assert faulted.returncode == 0, out + err
    report = json.loads(out)

    (fault,) = report["faults"]
    assert fault["target"].startswith(f"sandbox host {second} ") and "storage wiped" in fault["detail"]
    result = report["trajectories"][0]
    assert result["status"] == "completed"
    assert (result["token_sha256"], result["env_sha256"]) == (clean["token_sha256"], clean["env_sha256"])
    (recovery,) = result["recoveries"]
    assert recovery["source"].startswith("checkpoint@") and recovery["consistent"], recovery

    # The lost host comes back empty, with the base image, and serves again.
    belayer(env, "up")
    assert service_status(env)["sandbox-worker.1"]["healthy"]
    listed = sandbox_hosts.run_podman_on(config, 1, "ps", "-a", "--format", "{{.Names}}")
    assert listed.returncode == 0 and listed.stdout.split() == []
    belayer(env, "down")
    assert sandbox_hosts.members(config, 1) == []
