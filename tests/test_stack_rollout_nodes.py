"""`belayer up --rollout-nodes 2`: two real rollout nodes, each with its own id, engines,
shared memory and task queue, listed by `status`, each a target of its own faults (a lost
one stays down until `up`), refused a shrink while they run, and both stopped and cleaned
up by `down`."""

from __future__ import annotations

import json

import psutil
import pytest

from belayer.rollout import shm
from tests.test_stack import belayer, private_stack, service_status  # noqa: F401 (private_stack: a fixture)

NODES = ("rollout-node", "rollout-node.1")


@pytest.mark.usefixtures("tiny_model")
def test_two_rollout_nodes_run_side_by_side_and_go_together(private_stack):
    config, env = private_stack
    first = config.rollout.node_id
    ids = (first, f"{first}.1")
    belayer(env, "up", "--rollout-nodes", "2", "--only", ",".join(("temporal", "seaweedfs", *NODES)))

    status = service_status(env)
    for name, node_id in zip(NODES, ids, strict=True):
        assert status[name]["healthy"], status[name]
        assert f"polling belayer-rollout-{node_id} as belayer-rollout-{node_id}@" in status[name]["detail"]
        assert shm.leftover_segments(node_id), f"node {node_id} holds no shared memory"
    assert status[NODES[0]]["pid"] != status[NODES[1]]["pid"]
    # Each node's segments are its own: the first node's never include the second's.
    assert not set(shm.leftover_segments(ids[0])) & set(shm.leftover_segments(ids[1]))
    # `status` without the flag knows the running stack's nodes.
    assert json.loads((config.state_dir / "run" / "topology.json").read_text())["rollout_nodes"] == 2

    # A fault aimed at the second node loses it (one of several: it stays down, its turns
    # would move to the first) and leaves the first alone; `up` brings it back.
    crash = json.loads(belayer(env, "chaos", "node-crash", "--node", ids[1]).stdout)
    assert crash["target"] == f"{NODES[1]} pid {status[NODES[1]]['pid']}" and crash["detail"].endswith(
        "left down"
    )
    assert not service_status(env)[NODES[1]]["healthy"] and not shm.leftover_segments(ids[1])
    belayer(env, "up", "--only", NODES[1])
    after = service_status(env)
    assert after[NODES[1]]["healthy"] and after[NODES[1]]["pid"] != status[NODES[1]]["pid"]
    assert after[NODES[0]]["pid"] == status[NODES[0]]["pid"]
    unknown = belayer(env, "chaos", "engine-crash", "--node", "nope", check=False)
    assert (
        unknown.returncode == 1
        and f"no rollout node 'nope' in this stack; its nodes are {ids[0]}, {ids[1]}" in unknown.stderr
    )
    status = after

    shrink = belayer(env, "up", "--rollout-nodes", "1", check=False)
    assert shrink.returncode == 1
    assert "the stack runs 2 rollout nodes; `belayer down` first" in shrink.stderr
    assert all(psutil.pid_exists(status[name]["pid"]) for name in NODES)

    belayer(env, "down")
    assert not any(shm.leftover_segments(node_id) for node_id in ids)
    assert not (config.state_dir / "run" / "topology.json").exists()
    assert not any(psutil.pid_exists(status[name]["pid"]) for name in NODES)
