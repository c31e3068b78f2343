"""A rollout node's id is claimed before the node touches anything: on its machine by a
lock the kernel drops with the process, across machines through Temporal's pollers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from belayer.rollout import shm
from belayer.rollout.identity import (
    LIVE_POLLER_S,
    DuplicateNodeIdError,
    claim_on_this_machine,
    cleanup_node,
    other_host_pollers,
)
from belayer.workers.rollout.worker import banner, node_id_claimed
from belayer.workers.runner import main

HOLD = (
    "import sys, time; from belayer.rollout.identity import claim_on_this_machine as c; "
    "l = c(sys.argv[1]); print('held', flush=True); time.sleep(600)"
)


def holder(node_id: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, node_id], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.usefixtures("local_processes")
def test_a_second_claim_on_the_machine_is_refused_until_the_holder_dies():
    node_id = f"t{uuid.uuid4().hex[:8]}"
    proc = holder(node_id)
    try:
        with pytest.raises(
            DuplicateNodeIdError, match=rf"'{node_id}' is in use on this machine by pid {proc.pid}"
        ) as err:
            claim_on_this_machine(node_id)
        assert "BELAYER_ROLLOUT__NODE_ID" in str(err.value)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # a crash: the kernel releases the lock
        proc.wait(timeout=10)
    with claim_on_this_machine(node_id) as lock:  # the restart after the crash is not refused
        lock.seek(0)
        assert lock.read() == f"pid {os.getpid()}\n"


def test_other_ids_are_free_while_one_is_held():
    node_id = f"t{uuid.uuid4().hex[:8]}"
    with claim_on_this_machine(node_id), claim_on_this_machine(node_id + "b"):
        pass


def test_only_live_rollout_nodes_of_other_hosts_count():
    seen = [
        ("belayer-rollout-n1@host-b:41", 3.0),  # live, elsewhere: a twin
        ("belayer-rollout-n1@host-a:40", 1.0),  # this host: a predecessor of this process
        ("belayer-rollout-n1@host-c:42", LIVE_POLLER_S + 5),  # gone: not seen for too long
        ("temporal-cli@host-d:7", 1.0),  # not a rollout node
        ("belayer-rollout-n1@host-b.example.com:43", 2.0),  # a dotted host name
    ]
    assert other_host_pollers(seen, "host-a") == [
        "belayer-rollout-n1@host-b:41",
        "belayer-rollout-n1@host-b.example.com:43",
    ]
    assert other_host_pollers(seen[1:2], "host-a") == []


@pytest.mark.usefixtures("local_processes")
def test_a_live_nodes_shared_memory_is_not_cleaned_up_by_another_stack():
    """`down` of a stack whose node had the same id (a test stack beside a developer's)
    must leave the live node's segments alone, and clean them once no node holds the id."""
    node_id = f"t{uuid.uuid4().hex[:8]}"
    segment = shm.arena_path(node_id, 1)
    segment.write_bytes(b"arena")
    proc = holder(node_id)
    try:
        assert cleanup_node(node_id) == [] and segment.exists()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    try:
        assert cleanup_node(node_id) == [str(segment)] and not segment.exists()
    finally:
        segment.unlink(missing_ok=True)


def test_a_node_refused_while_it_starts_to_serve_exits_1_with_the_reason(monkeypatch, capsys):
    """A live twin on another host is found once serving starts (`refuse_a_live_twin`):
    the worker process still exits 1 with the message and no traceback, and lets go of
    its id on this machine."""
    node_id = f"t{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("BELAYER_ROLLOUT__NODE_ID", node_id)

    async def serve_beside_a_twin(_config) -> None:
        raise DuplicateNodeIdError(f"rollout node id {node_id!r} is served by a live node on another host")

    assert main(serve_beside_a_twin, banner, hold=node_id_claimed) == 1
    out, err = capsys.readouterr()
    assert f"belayer rollout node {node_id}: serving" in out
    assert err == f"error: rollout node id {node_id!r} is served by a live node on another host\n"
    with claim_on_this_machine(node_id):
        pass
