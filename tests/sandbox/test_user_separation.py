"""Who is who in a sandbox (issue 35 §1), tried on real podman + CRIU.

Every sandbox runs in a user namespace of its own, the same fixed map on every host, so
its root is no user of the host's: in a fresh sandbox, one restored from its checkpoint,
a fork, and one restored on another host (belayer/stack/sandbox_hosts.py: its own podman
storage, runc state and channels). Inside, the agent (uid 1000), the verifier that runs
the reward check (uid 1001) and PID 1 (the supervisor) are three users: the agent can
neither read what the verifier keeps to itself, nor signal the verifier's processes, nor
raise PID 1's OOM score to make the OOM killer end the sandbox.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from belayer.config import load_config
from belayer.sandbox.models import Action, ForkTarget
from belayer.sandbox.podman import USERNS_BASE, USERNS_SIZE
from belayer.stack import sandbox_hosts

TRAJ = "traj-users"
AGENT_UID = "1000"
# A process of the agent's that outlives its action: CRIU restores it under the same pid.
BACKGROUND = "nohup sleep 1000 >/dev/null 2>&1 & echo $!"
# As the container's root, from outside the agent's reach: the map and the uids of a process.
PROBE = "cat /proc/{pid}/uid_map; grep ^Uid: /proc/{pid}/status"
# The second host restores the exported archive in namespaces of its own, then removes it.
ON_ANOTHER_HOST = """
import json, sys
from pathlib import Path
from belayer.config import load_config
from belayer.sandbox.podman import PodmanBackend
from belayer.stack import sandbox_hosts

archive, sandbox_id, k, probe = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
config = load_config()
sandbox_hosts.enter(config, k)
sandbox_hosts.import_base_image(config)
backend = PodmanBackend(config.sandbox, config.state_dir, config.cache_dir)
try:
    name = backend.restore(Path(archive), sandbox_id, 1)
    print(json.dumps(backend.podman("exec", name, "sh", "-c", probe).stdout.decode()))
finally:
    backend.destroy(sandbox_id)
"""


def act(step: int, command: str, trajectory: str = TRAJ) -> Action:
    return Action(trajectory=trajectory, step=step, command=command)


def assert_agent_in_user_namespace(probe_output: str) -> None:
    """uid_map: container uids 0.. are host uids USERNS_BASE.. (never the identity map
    `0 0 4294967295` of a container without one); the process is the agent's on every uid."""
    uid_map, uids = probe_output.splitlines()
    assert uid_map.split() == ["0", str(USERNS_BASE), str(USERNS_SIZE)], probe_output
    assert uids.split()[1:] == [AGENT_UID] * 4, probe_output


def probe(sandboxes, container: str, pid: int) -> str:
    return sandboxes.backend.podman("exec", container, "sh", "-c", PROBE.format(pid=pid)).stdout.decode()


def test_the_agent_runs_in_a_user_namespace_fresh_restored_and_forked(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    started = host.exec(handle, act(1, BACKGROUND))
    pid = int(started.stdout)
    assert_agent_in_user_namespace(probe(sandboxes, handle.container, pid))

    ref = host.checkpoint(handle)
    restored, _ = host.restore(ref, handle.generation + 1)
    assert_agent_in_user_namespace(probe(sandboxes, restored.container, pid))

    (outcome,) = host.fork(
        ref, [ForkTarget(sandbox_id=f"sbx-users-{sandboxes.token[:8]}", trajectory="member")]
    )
    assert outcome.handle, outcome.error
    assert_agent_in_user_namespace(probe(sandboxes, outcome.handle.container, pid))


def test_the_agent_runs_in_a_user_namespace_restored_on_another_host(sandboxes, tmp_path):
    host = sandboxes.host
    handle = sandboxes.create()
    pid = int(host.exec(handle, act(1, BACKGROUND)).stdout)
    archive = tmp_path / "plain.tar"
    sandboxes.backend.export_checkpoint(handle.container, archive)
    config = load_config()
    k = 1000 + os.getpid() % 100000  # a host of this test process's own
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--uts", "--propagation", "private", "--", sys.executable, "-c", ON_ANOTHER_HOST,
             str(archive), handle.sandbox_id, str(k), PROBE.format(pid=pid)],
            capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
    finally:
        sandbox_hosts.wipe(config, k)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_agent_in_user_namespace(json.loads(done.stdout.splitlines()[-1]))


def test_the_agent_cannot_read_or_signal_the_verifier_nor_raise_pid1s_oom_score(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    # The check leaves a process and a file of its own (0600) behind, as a verifier could.
    check = host.exec(
        handle,
        act(
            1,
            "nohup sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/verifier-pid; "
            "umask 077; echo verdict > /tmp/verifier-secret; id -u",
        ),
        isolated=True,
    )
    assert check.stdout == "1001\n", check
    verifier_pid = (
        sandboxes.backend.podman("exec", handle.container, "cat", "/tmp/verifier-pid").stdout.decode().strip()
    )

    tries = {
        "id -u": None,
        "cat /tmp/verifier-secret": "Permission denied",
        f"kill -0 {verifier_pid}": "Operation not permitted",
        f"kill -KILL {verifier_pid}": "Operation not permitted",
        "echo 1000 > /proc/1/oom_score_adj": "Permission denied",
    }
    outcomes = [host.exec(handle, act(step, command)) for step, command in enumerate(tries, start=2)]
    assert outcomes[0].stdout == f"{AGENT_UID}\n", outcomes[0]
    for observation, refusal in zip(outcomes[1:], list(tries.values())[1:], strict=True):
        assert observation.exit_code != 0 and refusal in observation.stderr, observation
    after = sandboxes.backend.podman("exec", handle.container, "sh", "-c",
                                     f"kill -0 {verifier_pid} && cat /proc/1/oom_score_adj").stdout  # fmt: skip
    assert after == b"0\n"  # the verifier's process lives on, PID 1 is not the OOM killer's choice
