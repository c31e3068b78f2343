"""Two sandbox hosts and two rollout nodes on one machine, really separate where recovery
cares, with room for two sandboxes each (`sandbox.max_sandboxes`):

* a rollout node lost mid-run, and the trajectory's turns finished on the other node; a
  whole sandbox host lost mid-trajectory (its worker, podman, containers killed, its
  storage wiped) and the trajectory finished on the other host from the object store;
  each with the tokens and the workspace of the run without a fault;
* four trajectories at once placed two per host; one host drained while they run: its
  sandboxes moved from the drain's checkpoints (nothing replayed) to the other host,
  which waits for room, and every trajectory identical to the clean run;
* a host that loses power with its disk kept: the trajectory recovers elsewhere, and the
  host, back, removes its stale container before it serves anything;
* a node at its capacity refuses a turn at once, and the other node serves it;
* the two rollout nodes side by side, each with its own id, engines, shared memory and
  queue, each a target of its own faults.

The lost ones come back with `belayer up`, and nothing is left running after `down`: no
process, no node's shared memory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from belayer.client import trajectory_progress
from belayer.rollout import shm
from belayer.stack import sandbox_hosts
from belayer.stack.process import ManagedProcess
from belayer.temporal_client import connect
from tests.conftest import ROOM_PER_HOST as ROOM  # sandboxes per host
from tests.test_stack import BELAYER, belayer, service_status

NODES = ("rollout-node", "rollout-node.1")
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
def two_hosts(two_host_stack):
    """The session's whole stack grown to two sandbox hosts and two rollout nodes
    (tests/conftest.py), for the module's tests in order; a process of the second host left
    after `down` is a leak too."""
    return two_host_stack


_IN_BACKGROUND: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_run_left_behind():
    """A test stopped midway (a failure, Ctrl-C) ends the runs it started in the background."""
    yield
    for process in _IN_BACKGROUND:
        if process.poll() is None:
            process.kill()
            process.wait()
    _IN_BACKGROUND.clear()


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("two-hosts") / "two-hosts.yaml"
    path.write_text(WORKLOAD)
    return path


@pytest.fixture(scope="module")
def clean(two_host_stack, workload) -> dict:
    """The workload's trajectory without faults, run once for the module: a faulted run
    must end with its tokens and workspace, whichever host and node it ran on."""
    result = run(two_host_stack[1], workload)["trajectories"][0]
    assert result["status"] == "completed" and not result["recoveries"], result
    return result


def run(env, workload: Path, *args: str, background: bool = False):
    argv = [*BELAYER, "run", str(workload), "--json", *args]
    if background:
        _IN_BACKGROUND.append(subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
        ))  # fmt: skip
        return _IN_BACKGROUND[-1]
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_a_lost_node_and_a_lost_host_are_each_recovered_on_the_other(two_hosts, workload, clean):
    config, env = two_hosts
    second = f"{socket.gethostname()}-h1"
    status = service_status(env)
    assert status["sandbox-worker"]["healthy"] and status["sandbox-worker.1"]["healthy"]
    assert (
        f"polling belayer-sandbox-{second} as belayer-sandbox@{second}:"
        in status["sandbox-worker.1"]["detail"]
    )
    # One policy per stack: the node the stack grew by serves what the first serves, even
    # after a run of this session's other tests published trained weights to the first.
    assert len({served_version(config, node_id) for node_id in node_ids(env)}) == 1
    assert not any("ANOTHER NODE" in status[name]["detail"] for name in NODES), status

    # The node serving the trajectory is lost: its turns finish on the other node.
    node_lost = run(env, workload, "--chaos", "node-crash@step=2")
    (fault,) = node_lost["faults"]
    assert fault["target"].startswith("rollout-node") and fault["detail"].endswith("left down"), fault
    result = node_lost["trajectories"][0]
    assert result["status"] == "completed"
    assert_same_run(config, result, clean)
    lost_node = fault["target"].split()[0]
    assert not service_status(env)[lost_node]["healthy"]
    belayer(env, "up")
    assert service_status(env)[lost_node]["healthy"]

    # Only the second host serves while the run starts: the trajectory's sandbox lives there.
    ManagedProcess("sandbox-worker", config.state_dir).stop()
    faulted = run(env, workload, "--chaos", "sandbox-host-crash@step=3", background=True)
    lost = ManagedProcess("sandbox-worker.1", config.state_dir)
    while (
        lost.running() is not None or sandbox_hosts.host_dir(config, 1).exists()
    ) and faulted.poll() is None:
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
    assert_same_run(config, result, clean)
    (recovery,) = result["recoveries"]
    assert recovery["source"].startswith("checkpoint@") and recovery["consistent"], recovery

    # The lost host comes back empty, with the base image, and serves again.
    belayer(env, "up")
    assert service_status(env)["sandbox-worker.1"]["healthy"]
    assert containers_on(config, 1) == []


def test_sandboxes_spread_by_load_and_a_drain_moves_every_one_off_its_host(two_hosts, tmp_path):
    config, env = two_hosts
    belayer(env, "up")
    workload = tmp_path / "drain.yaml"
    workload.write_text(DRAIN_WORKLOAD)
    # Trajectories that create their own sandboxes (--no-fork): a group's forks start on
    # its set-up sandbox's host, as many as it has room for (placing them is issue 41's).
    many = ("--repeats", str(2 * ROOM), "--concurrency", str(2 * ROOM), "--no-fork")
    before = placed_on(config)
    clean = run(env, workload, *many)
    assert all(t["status"] == "completed" and not t["recoveries"] for t in clean["trajectories"]), clean
    placed = [queue for sid, queue in placed_on(config).items() if sid not in before]
    assert sorted(placed) == sorted([host_queue(config, 0)] * ROOM + [host_queue(config, 1)] * ROOM)

    faulted = run(env, workload, *many, background=True)
    on_second = host_queue(config, 1)
    asyncio.run(until_running_trajectories(
        config, faulted, lambda seen: sum(p.sandbox is not None and p.sandbox.host_queue == on_second
                                          for p in seen) >= ROOM, f"{ROOM} sandboxes running on the second host"))  # fmt: skip
    drained = belayer(env, "drain", sandbox_hosts.host_name(1), "--deadline", "60", "--json")
    out, err = faulted.communicate(timeout=600)
    assert faulted.returncode == 0, out + err
    report = json.loads(drained.stdout)
    assert [s["outcome"] for s in report["sandboxes"]] == ["moved"] * ROOM, report
    assert not service_status(env)["sandbox-worker.1"]["healthy"]  # it left
    results = json.loads(out)["trajectories"]
    assert len(set(hashes(clean["trajectories"]))) == 1, "the repeats of one task share its seed"
    for result in results:
        assert_same_run(config, result, clean["trajectories"][0])
    moved = [r for t in results for r in t["recoveries"]]
    assert len(moved) == ROOM and all(r["consistent"] and r["replayed_steps"] == 0 for r in moved), moved
    assert all(any("a drain took" in note for note in r["notes"]) for r in moved), moved
    print("drain figures:", json.dumps({"report": report, "time_lost_s": [r["time_lost_s"] for r in moved]}))
    belayer(env, "up")
    assert service_status(env)["sandbox-worker.1"]["healthy"]


def test_a_host_back_after_a_power_cut_removes_its_stale_container_before_serving(two_hosts, workload, clean):
    config, env = two_hosts
    belayer(env, "up")
    ManagedProcess(
        "sandbox-worker", config.state_dir
    ).stop()  # the trajectory's sandbox goes to the second host
    earlier = set(containers_on(config, 1))  # a drained or finished sandbox's, not yet removed
    faulted = run(env, workload, background=True)
    asyncio.run(until_running_trajectories(
        config, faulted, lambda seen: any(p.step >= 1 for p in seen), "a step taken"))  # fmt: skip
    (stale,) = set(containers_on(config, 1)) - earlier
    # Power cut at once, with steps left to recover: every process of the host dies, its
    # disk stays. The host that takes over starts only afterwards.
    sandbox_hosts.end(config, 1)
    sandbox_hosts.clear_volatile(config, 1)
    belayer(env, "up", "--only", "sandbox-worker")
    out, err = faulted.communicate(timeout=600)
    assert faulted.returncode == 0, out + err
    result = json.loads(out)["trajectories"][0]
    assert result["status"] == "completed" and len(result["recoveries"]) == 1, result
    assert_same_run(config, result, clean)

    log = ManagedProcess("sandbox-worker.1", config.state_dir).log_file
    logged_before = log.read_text()
    belayer(env, "up")  # back, with its disk: the container is there, its lineage is elsewhere
    assert service_status(env)["sandbox-worker.1"]["healthy"]
    fenced = re.search(r"fenced superseded containers (.*)", log.read_text()[len(logged_before) :])
    assert fenced and stale in fenced.group(1).split(", "), "the stale container was not fenced"
    assert containers_on(config, 1) == []


def test_a_full_node_refuses_a_turn_at_once_and_another_node_serves_it(two_hosts, tmp_path):
    """A node at its declared capacity (here one sequence) never queues a turn in its engine
    nor in a queue only it reads: a turn that reaches it while it is full is refused at
    once, and the trajectory sends the turn to the shared queue, where a node with room
    serves it. Made certain, not left to timing: with the other node down, two trajectories
    take their first turn on the small node and wait in their sandboxes for a file; the
    other node comes up; the 'hog' is let go and its long second turn fills the small node
    (its affinity); then the 'gated' one is, and its second turn, asked on the same node, is
    refused there and served by the other. `belayer status` shows the refusal; the tokens
    and workspace equal an uncrowded run's."""
    config, env = two_hosts
    small, other = node_ids(env)
    gated, hog = tmp_path / "gated.yaml", tmp_path / "hog.yaml"
    gated.write_text(gated_workload("gated", second_turn_tokens=8))
    hog.write_text(gated_workload("hog", second_turn_tokens=1800))
    uncrowded = finish(release(config, *start_gated(config, env, gated)))
    for name in NODES:
        ManagedProcess(name, config.state_dir).stop()
    try:
        belayer(env | {"BELAYER_ROLLOUT__MAX_NUM_SEQS": "1"}, "up", "--only", NODES[0])
        assert served_capacity(config, small)["sequences"] == 1
        waiting, hogging = start_gated(config, env, gated), start_gated(config, env, hog)
        belayer(env, "up", "--only", NODES[1])  # they wait for their files meanwhile
        release(config, *hogging)
        (filling,) = asyncio.run(until_generating(config, hogging[0], "hog", ["served", "running"]))
        assert filling["node"] == small, filling
        crowded, long_turn = finish(release(config, *waiting)), finish(hogging[0])
        refused = served_capacity(config, small)["refused"]
        assert refused >= 1 and f"{refused} refused at capacity" in service_status(env)[NODES[0]]["detail"]
    finally:  # the module's later tests need both nodes, at their own capacity
        for name in NODES:
            ManagedProcess(name, config.state_dir).stop()
        belayer(env, "up")

    assert long_turn["status"] == "completed", long_turn
    assert crowded["status"] == "completed" and hashes([crowded]) == hashes([uncrowded]), (crowded, uncrowded)
    attempts = asyncio.run(generate_turns(config, [crowded["id"]]))
    assert [(a["outcome"], a["node"]) for a in attempts] == [
        ("served", small), ("refused", small), ("served", other)
    ], attempts  # fmt: skip


def gated_workload(task: str, second_turn_tokens: int) -> str:
    """One short turn, a wait in the sandbox for /workspace/g/go (`release` writes it; the
    action may wait 10 minutes), then a turn of `second_turn_tokens` tokens."""
    return f"""\
tasks:
  - id: {task}
    setup: [mkdir -p /workspace/g]
    action_timeout_s: 600
    turns:
      - {{think_tokens: 8, bash: "until [ -e /workspace/g/go ]; do sleep 0.1; done; echo released"}}
      - {{think_tokens: {second_turn_tokens}, bash: "echo served"}}
"""


def start_gated(config, env, workload: Path) -> tuple[subprocess.Popen, object]:
    """A run of a gated workload (its task is named as the file), once its trajectory has
    taken its first turn and waits."""
    waiting = run(env, workload, background=True)
    return waiting, asyncio.run(until_progress(config, waiting, workload.stem, ["served"]))


def release(config, waiting: subprocess.Popen, progress) -> subprocess.Popen:
    """Write the file the trajectory's sandbox waits for."""
    host = next(k for k in (0, 1) if host_queue(config, k) == progress.sandbox.host_queue)
    touched = sandbox_hosts.run_podman_on(
        config, host, "exec", progress.sandbox.container, "touch", "/workspace/g/go"
    )
    assert touched.returncode == 0, touched.stderr
    return waiting


def finish(running: subprocess.Popen) -> dict:
    """The run's one trajectory."""
    out, err = running.communicate(timeout=600)
    assert running.returncode == 0, out + err
    (result,) = json.loads(out)["trajectories"]
    return result


def served_capacity(config, node_id: str) -> dict:
    """The node's declared capacity and its refusals, as it records them (`belayer status`)."""
    return json.loads((config.state_dir / "run" / f"rollout-{node_id}.roles.json").read_text())["capacity"]


async def until_generating(config, run_process, task: str, outcomes: list[str]) -> list[dict]:
    """Until the running trajectory of `task` has generate attempts of these outcomes
    (`generate_attempts`); its attempts running now."""
    progress = await until_progress(config, run_process, task, outcomes)
    client = await connect(config.temporal, config.storage.encryption_key)
    attempts = await generate_attempts(client.get_workflow_handle(progress.trajectory_id))
    return [a for a in attempts if a["outcome"] == "running"]


async def until_progress(config, run_process, task: str, outcomes: list[str]):
    """Until the running trajectory of `task` has generate attempts of these outcomes
    (`generate_attempts`); its progress then. Fails if the run ends first."""
    client = await connect(config.temporal, config.storage.encryption_key)
    query = "WorkflowType = 'TrajectoryWorkflow' AND ExecutionStatus = 'Running'"
    while run_process.poll() is None:
        async for execution in client.list_workflows(query):
            handle = client.get_workflow_handle(execution.id)
            try:
                progress = await trajectory_progress(handle)
            except Exception:  # not started yet, or racing its end
                continue
            if progress.task == task and [a["outcome"] for a in await generate_attempts(handle)] == outcomes:
                return progress
        await asyncio.sleep(0.1)
    raise AssertionError(f"the run of {task} ended before generating {outcomes}: {run_process.communicate()}")


async def generate_turns(config, trajectory_ids: list[str]) -> list[dict]:
    """Every generate attempt of the trajectories (`generate_attempts`), in their order."""
    client = await connect(config.temporal, config.storage.encryption_key)
    attempts = []
    for trajectory_id in trajectory_ids:
        attempts += await generate_attempts(client.get_workflow_handle(trajectory_id))
    return attempts


async def generate_attempts(handle) -> list[dict]:
    """Every generate attempt of a trajectory so far: from its Temporal history, the node
    that ran it (its worker identity) and whether it was served or refused for want of room;
    then the attempt running now, if any, which the history records only once it ends."""
    from temporalio.api.enums.v1 import PendingActivityState

    attempts, generate, node = [], set(), {}
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            if event.activity_task_scheduled_event_attributes.activity_type.name == "generate":
                generate.add(event.event_id)
        elif event.HasField("activity_task_started_event_attributes"):
            started = event.activity_task_started_event_attributes
            if started.scheduled_event_id in generate:
                node[started.scheduled_event_id] = started.identity.removeprefix("belayer-rollout-").split(
                    "@"
                )[0]
        elif event.HasField("activity_task_completed_event_attributes"):
            done = event.activity_task_completed_event_attributes.scheduled_event_id
            if done in generate:
                attempts.append({"trajectory": handle.id, "node": node[done], "outcome": "served"})
        elif event.HasField("activity_task_failed_event_attributes"):
            failed = event.activity_task_failed_event_attributes
            if failed.scheduled_event_id in generate:
                kind = (
                    failed.failure.cause.application_failure_info.type
                    or failed.failure.application_failure_info.type
                )
                outcome = "refused" if kind == "NodeFull" else "failed"
                attempts.append(
                    {"trajectory": handle.id, "node": node[failed.scheduled_event_id], "outcome": outcome}
                )
    pending = (await handle.describe()).raw_description.pending_activities
    attempts += [
        {"trajectory": handle.id, "node": a.last_worker_identity.removeprefix("belayer-rollout-").split("@")[0],
         "outcome": "running"}
        for a in pending
        if a.activity_type.name == "generate" and a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
    ]  # fmt: skip
    return attempts


def test_two_rollout_nodes_run_side_by_side_each_a_target_of_its_own_faults(two_hosts, monkeypatch):
    """`belayer up --rollout-nodes 2`: each node with its own id, engines, shared memory and
    task queue, listed by `status`; a lost one stays down until `up` and leaves the other
    alone; a publish reaches both; a shrink is refused while they run; `down` stops both
    (so it runs last)."""
    config, env = two_hosts
    ids = node_ids(env)
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
    assert crash["target"] == f"{NODES[1]} pid {status[NODES[1]]['pid']}"
    assert crash["detail"].endswith("left down")
    assert not service_status(env)[NODES[1]]["healthy"] and not shm.leftover_segments(ids[1])
    belayer(env, "up", "--only", NODES[1])
    after = service_status(env)
    assert after[NODES[1]]["healthy"] and after[NODES[1]]["pid"] != status[NODES[1]]["pid"]
    assert after[NODES[0]]["pid"] == status[NODES[0]]["pid"]
    unknown = belayer(env, "chaos", "engine-crash", "--node", "nope", check=False)
    assert unknown.returncode == 1
    assert f"no rollout node 'nope' in this stack; its nodes are {ids[0]}, {ids[1]}" in unknown.stderr

    # A publish through the rollout API (as `belayer train` publishes) reaches both nodes.
    version = served_version(config, ids[0]) + 1
    assert asyncio.run(publish_built_model(env, monkeypatch, version)) == dict.fromkeys(ids, version)
    assert [served_version(config, node_id) for node_id in ids] == [version, version]

    shrink = belayer(env, "up", "--rollout-nodes", "1", check=False)
    assert shrink.returncode == 1
    assert "the stack runs 2 rollout nodes; `belayer down` first" in shrink.stderr
    assert all(psutil.pid_exists(after[name]["pid"]) for name in NODES)

    # `down` stops both nodes and the second host, and leaves nothing behind.
    nodes = [service_status(env)[name]["pid"] for name in NODES]
    belayer(env, "down")
    assert sandbox_hosts.members(config, 1) == []
    assert not any(shm.leftover_segments(node_id) for node_id in ids)
    assert not (config.state_dir / "run" / "topology.json").exists()
    assert not any(psutil.pid_exists(pid) for pid in nodes)


def node_ids(env) -> tuple[str, str]:
    return env["BELAYER_ROLLOUT__NODE_ID"], f"{env['BELAYER_ROLLOUT__NODE_ID']}.1"


def served_version(config, node_id: str) -> int:
    """The weights version the node serves, as it records it."""
    return json.loads((config.state_dir / "run" / f"rollout-{node_id}.roles.json").read_text())[
        "weights_version"
    ]


async def publish_built_model(env, monkeypatch, version: int) -> dict[str, int]:
    """The built model's weights published as `version` by a client that reads the stack's
    configuration as a user's trainer does: node id -> the version it then serves."""
    from safetensors.torch import load_file

    from belayer import RolloutClient
    from belayer.model.build import model_path

    for name, value in env.items():
        if name.startswith("BELAYER_"):
            monkeypatch.setenv(name, value)
    client = await RolloutClient.connect()
    built = model_path(client.config.rollout.model, client.config.cache_dir)
    published = await client.publish(load_file(str(built / "model.safetensors")), version=version)
    return {result.node_id: result.version for result in published}


async def until_running_trajectories(config, run_process, holds, what: str) -> None:
    """Until `holds(progress of every running trajectory of the stack)`, e.g. their sandboxes
    placed on a host, or a step taken so that a lost host has state to recover (a cut
    while a sandbox is being created is retried as a creation elsewhere, not a recovery).
    Counting containers instead would count those an earlier test left, and ones still being
    created. Fails if the run ends first."""
    client = await connect(config.temporal, config.storage.encryption_key)
    query = "WorkflowType = 'TrajectoryWorkflow' AND ExecutionStatus = 'Running'"
    while run_process.poll() is None:
        seen = []
        async for execution in client.list_workflows(query):
            with contextlib.suppress(Exception):  # not started yet, or racing its end
                seen.append(await trajectory_progress(client.get_workflow_handle(execution.id)))
        if holds(seen):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the run ended before {what}: {run_process.communicate()}")


DRAIN_WORKLOAD = """\
tasks:
  - id: drained
    setup:
      - mkdir -p /workspace/w
    turns:
      - {think_tokens: 16, bash: "cd /workspace/w && export STAGE=one && echo $STAGE > stage.txt && sleep 0.5"}
      - {think_tokens: 16, bash: "seq 1 300 > n.txt && sleep 0.5 && wc -l < n.txt"}
      - {think_tokens: 16, bash: "sha256sum n.txt > n.sum && sleep 0.5 && cat n.sum"}
      - {think_tokens: 16, bash: "export STAGE=two && echo $STAGE >> stage.txt && sleep 0.5 && cat stage.txt"}
      - {think_tokens: 16, bash: "awk '{ s += $1 } END { print s }' n.txt > total.txt && sleep 0.5 && cat total.txt"}
      - {think_tokens: 16, bash: "sleep 0.5 && ls -1 | sort && echo $STAGE"}
"""


def host_queue(config, k: int) -> str:
    return sandbox_hosts.host_queue(config, k)


def containers_on(config, k: int) -> list[str]:
    """The sandbox containers host k holds, in any state."""
    from belayer.sandbox.podman import LABEL_SANDBOX

    listed = sandbox_hosts.run_podman_on(config, k, "ps", "-a", "--filter", f"label={LABEL_SANDBOX}",
                                         "--format", "{{.Names}}")  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.split()


def placed_on(config) -> dict[str, str]:
    """sandbox id -> the host its first generation started on, from the lineage records
    (they outlive the sandboxes)."""
    from belayer.sandbox import lineage
    from belayer.storage.store import open_store

    store = open_store(config.storage, encrypted=False)
    try:
        prefix = config.sandbox.checkpoint_prefix
        ids = {
            key[len(prefix) :].split("/", 1)[0] for key in store.list(prefix) if "/lineage/g0000000000" in key
        }
        placed = {sid: lineage.LineageRecord.model_validate_json(
            store.get_bytes(lineage.record_key(prefix, sid, 0))).host_queue for sid in ids}  # fmt: skip
    finally:
        store.close()
    return placed


def hashes(trajectories) -> list[tuple[str, str]]:
    return [(t["token_sha256"], t["env_sha256"]) for t in trajectories]


def assert_same_run(config, result: dict, clean: dict) -> None:
    """`result` has the clean run's tokens and workspace; if not, the message says where
    the tokens part and what the engine gave each there: a near-tie between two tokens
    (logprobs a hair apart) reads differently from a different context."""
    if (result["token_sha256"], result["env_sha256"]) == (clean["token_sha256"], clean["env_sha256"]):
        return
    from belayer.storage.store import open_store
    from belayer.storage.tokenlog import PrefixRef
    from belayer.storage.trajectory_tokens import read_trajectory_tokens, where_they_part

    with open_store(config.storage, encrypted=False) as store:
        ours, theirs = (
            read_trajectory_tokens(store, PrefixRef.model_validate(r["context"])) for r in (result, clean)
        )
    raise AssertionError(
        f"{result['id']} differs from the clean run {clean['id']}: env {result['env_sha256'] == clean['env_sha256']}; "
        f"{where_they_part(ours, theirs)}; recoveries {result['recoveries']}"
    )
