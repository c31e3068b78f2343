"""A second rollout node with the id of the running one is refused, on the same machine
and from another host (its own host name and lock directory, as a separate machine would
have), with a message naming the setting; the running node's segments and service are
untouched."""

from __future__ import annotations

import subprocess
import sys

import pytest

from belayer.rollout import shm
from tests.test_stack import service_status

NODE = [sys.executable, "-m", "belayer.workers.rollout"]


def second_node(env, *, as_other_host: bool) -> subprocess.CompletedProcess:
    argv = NODE
    if as_other_host:  # another UTS and mount namespace: its own host name and /run/lock
        argv = [
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs none /run/lock && hostname twin-host && exec "$@"',
            "sh",
            *NODE,
        ]
    return subprocess.run(
        argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120
    )


@pytest.mark.parametrize("as_other_host", [False, True], ids=["same-machine", "other-host"])
def test_a_node_with_an_id_in_use_is_refused(stack, as_other_host):
    config, env = stack
    node_id = env["BELAYER_ROLLOUT__NODE_ID"]
    segments = shm.leftover_segments(node_id)
    assert segments, "the stack's node holds its segments"

    done = second_node(env, as_other_host=as_other_host)

    assert done.returncode == 1, done.stdout + done.stderr
    where = "is served by a live node on another host" if as_other_host else "is in use on this machine"
    assert f"rollout node id '{node_id}' {where}" in done.stderr
    assert "BELAYER_ROLLOUT__NODE_ID" in done.stderr and "Traceback" not in done.stderr
    assert shm.leftover_segments(node_id) == segments
    assert service_status(env)["rollout-node"]["healthy"]
