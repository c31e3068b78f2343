"""What the agent can reach of Belayer's own machinery inside a real sandbox, tried from
its shell: the capability-holding helper that starts each action, the OOM scores, the
freezer that holds its processes still while it is judged, and the workspace hash.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from belayer.sandbox.errors import CheckpointBlockedByAgent, CheckpointFailed
from belayer.sandbox.models import Action

TRAJ = "traj-reach"


def act(step: int, command: str) -> Action:
    return Action(trajectory=TRAJ, step=step, command=command)


def guarded_files(sandboxes, handle) -> list[str]:
    """What is in the journal's directory, read from the host (the agent cannot list it)."""
    out = sandboxes.backend.podman("exec", handle.container, "ls", "-A", "/var/lib/belayer").stdout
    return sorted(out.decode().split())


def test_loader_variables_never_reach_the_capability_holding_helper(sandboxes):
    """LD_DEBUG_OUTPUT makes the dynamic loader write where it names: in the helper, which
    still holds CAP_DAC_OVERRIDE when it is loaded, that was a write into the journal's
    guarded directory. The helper now starts from a fixed environment, and the names are
    not carried to the next action (the observation says so)."""
    host = sandboxes.host
    handle = sandboxes.create()
    before = guarded_files(sandboxes, handle)
    first = host.exec(
        handle, act(1, "export LD_DEBUG=files LD_DEBUG_OUTPUT=/var/lib/belayer/pwned; echo set")
    )
    assert first.exit_code == 0 and "LD_DEBUG, LD_DEBUG_OUTPUT" in first.note, first
    second = host.exec(handle, act(2, "echo ${LD_DEBUG_OUTPUT:-unset}"))
    assert second.stdout == "unset\n", second
    assert guarded_files(sandboxes, handle) == before


def test_the_agents_processes_are_the_oom_killers_first_choice(sandboxes):
    """PID 1 keeps oom_score_adj 0, every action (and the check) starts at 1000; nothing can
    go below 0 (no process holds CAP_SYS_RESOURCE) -- in a fresh sandbox and after a restore."""
    host = sandboxes.host
    handle = sandboxes.create()
    probe = ("cat /proc/1/oom_score_adj /proc/self/oom_score_adj; "
             "echo -1000 > /proc/self/oom_score_adj || echo refused")  # fmt: skip
    assert host.exec(handle, act(1, probe)).stdout == "0\n1000\nrefused\n"
    check = host.exec(handle, act(2, "cat /proc/self/oom_score_adj"), isolated=True)
    assert check.stdout == "1000\n", check
    ref = host.checkpoint(handle)
    restored, _ = host.restore(ref, handle.generation + 1)
    assert host.exec(restored, act(3, probe)).stdout == "0\n1000\nrefused\n"


SPAWNER = (
    # a respawner: a child that writes a counter and re-forks itself forever
    "nohup sh -c 'n=0; while :; do n=$((n+1)); echo $n > /workspace/count; sh -c \"sleep 0.01\"; done' "
    ">/dev/null 2>&1 & sleep 0.5; echo started"
)


def test_the_agents_processes_are_frozen_for_the_check_and_resumed_by_its_next_action(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    assert host.exec(handle, act(1, SPAWNER)).exit_code == 0
    # The check reads the counter twice, a second apart: frozen, it cannot have moved.
    check = host.exec(handle, act(2, "a=$(cat /workspace/count); sleep 1; b=$(cat /workspace/count); "
                                     "test \"$a\" = \"$b\" && echo still"), isolated=True)  # fmt: skip
    assert check.stdout == "still\n", check
    frozen_hash = host.workspace_hash(handle)
    assert host.workspace_hash(handle) == frozen_hash  # still frozen after the check
    resumed = host.exec(handle, act(3, "a=$(cat /workspace/count); sleep 1; b=$(cat /workspace/count); "
                                       "test \"$a\" != \"$b\" && echo moving"))  # fmt: skip
    assert resumed.stdout == "moving\n", resumed


def test_a_checkpoint_of_stopped_processes_completes(sandboxes):
    """CRIU waits forever on a stopped process in the frozen cgroup podman dumps from,
    holding the container's lock: a process the agent stopped itself, or the freezer's after
    a workspace hash, would wedge every later checkpoint. The host resumes them first."""
    host = sandboxes.host
    handle = sandboxes.create()
    stopped = host.exec(handle, act(1, "sleep 100000 & kill -STOP $!; " + SPAWNER))
    assert stopped.exit_code == 0, stopped
    host.workspace_hash(handle)  # freezes the spawner too
    done = bounded(lambda: checkpoint_retried_once(host, handle))  # today's dump takes about a second
    assert "result" in done, f"the checkpoint of a sandbox with stopped processes never finished: {done}"
    states = host.exec(handle, act(2, "ps -o stat= -C sleep | cut -c1 | sort | uniq -c | tr -s ' '"))
    assert "T" not in states.stdout, states


# A loop that keeps one of the agent's processes stopped: the supervisor's quiesce resumes
# it right before a dump, and the loop stops it again before CRIU reaches it.
STOP_LOOP = "nohup sh -c 'sleep 100000 & while :; do kill -STOP $!; done' >/dev/null 2>&1 & echo $!"


def checkpoint_retried_once(host, handle):
    """A checkpoint as its activity takes it: a retryable failure is tried once more (a
    loaded CI machine saw CRIU's 10 s limit on freezing the respawner's tree run out)."""
    try:
        return host.checkpoint(handle)
    except CheckpointFailed as exc:
        if not exc.retryable:
            raise
        return host.checkpoint(handle)


def bounded(call) -> dict:
    """`call()` in a thread, joined for a liveness bound (not a figure): its result or error."""
    done: dict = {}

    def run():
        try:
            done["result"] = call()
        except Exception as exc:  # noqa: BLE001 -- the test inspects it
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(240)
    return done


@pytest.mark.sandbox_config(podman_timeout_s=600)
def test_an_agent_that_keeps_a_process_stopped_cannot_wedge_a_checkpoint(sandboxes):
    """CRIU waits forever on a task stopped as podman froze the container, holding the
    container's lock, so `podman ps` on the whole host would wait with it. The dump
    watchdog ends such a dump and thaws the sandbox: the checkpoint fails as the agent's
    doing, not retried, and the sandbox runs on; once the agent stops, checkpoints work."""
    host = sandboxes.host
    handle = sandboxes.create()
    loop = host.exec(handle, act(1, STOP_LOOP))
    assert loop.exit_code == 0, loop
    for dump in (host.checkpoint, host.capture_checkpoint):  # streamed, and staged to a file
        done = bounded(lambda: dump(handle))  # noqa: B023 -- called at once
        assert done, "the dump never ended: the watchdog did not see the wedge"
        error = done.get("error")
        assert isinstance(error, CheckpointBlockedByAgent) and not error.retryable, done
        assert sandboxes.backend.podman("ps", "-q").returncode == 0  # the container's lock is free
    # Only what the loop itself stops is stopped: what CRIU had seized is resumed.
    states = host.exec(handle, act(2, f"ps -o stat= -p {loop.stdout.strip()} | cut -c1"))
    assert states.exit_code == 0 and states.stdout in ("S\n", "R\n"), states
    stop = host.exec(handle, act(3, f"kill -KILL {loop.stdout.strip()}; kill -CONT -1; echo stopped"))
    assert stop.stdout == "stopped\n", stop
    assert "result" in bounded(lambda: host.checkpoint(handle))


def test_a_process_running_a_file_it_deleted_is_checkpointed_and_restored(sandboxes):
    """A server whose library was upgraded under it, a program run from /tmp and removed:
    CRIU dumps the deleted file's contents (6.5 MiB here, over CRIU's default ghost limit
    of 1 MiB, which failed every later checkpoint of the sandbox)."""
    host = sandboxes.host
    handle = sandboxes.create()
    started = host.exec(handle, act(1, "cp /usr/bin/python3.11 /tmp/py && "
                                       "(nohup /tmp/py -c 'import time; time.sleep(100000)' >/dev/null 2>&1 &); "
                                       "sleep 1; rm /tmp/py; pgrep -f time.sleep"))  # fmt: skip
    assert started.exit_code == 0, started
    restored, _ = host.restore(host.checkpoint(handle), handle.generation + 1)
    exe = host.exec(restored, act(2, f"readlink /proc/{started.stdout.strip()}/exe"))
    assert exe.stdout == "/tmp/py (deleted)\n", exe


def test_a_check_may_declare_that_the_agents_processes_keep_running(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    assert host.exec(handle, act(1, SPAWNER)).exit_code == 0
    check = host.exec(
        handle,
        act(
            2,
            'a=$(cat /workspace/count); sleep 1; b=$(cat /workspace/count); test "$a" != "$b" && echo moving',
        ),
        isolated=True,
        processes="running",
    )
    assert check.stdout == "moving\n", check


def test_the_checks_environment_is_its_own(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    host.exec(handle, act(1, "export PYTHONPATH=/workspace TMPDIR=/workspace; echo 'x' > ~/.gitconfig"))
    check = host.exec(handle, act(2, "echo $HOME; ls -A $HOME | wc -l; echo $TMPDIR $PYTHONNOUSERSITE "
                                     "$PYTHONSAFEPATH $GIT_CONFIG_GLOBAL $GIT_CONFIG_NOSYSTEM ${PYTHONPATH:-none}"),
                      isolated=True)  # fmt: skip
    home, count, rest = check.stdout.splitlines()
    assert home.startswith("/tmp/belayer-verifier-") and count == "0", check
    assert rest == f"{home.rsplit('/', 1)[0]}/tmp 1 1 /dev/null 1 none", check
    gone = host.exec(handle, act(3, f"ls -d {home} 2>/dev/null || echo removed"))
    assert gone.stdout == "removed\n", gone


def test_the_workspace_hash_never_blocks_on_a_fifo_swapped_in(sandboxes):
    """A process that keeps replacing files with FIFOs: between the hash's lstat and its
    open, a regular file could become a FIFO and the open would block forever (the check
    ends as an infrastructure timeout). The hash freezes the agent first and opens without
    blocking; a FIFO left in the tree is hashed as what it is."""
    host = sandboxes.host
    handle = sandboxes.create()
    swapper = (
        "cat > /tmp/swap.py <<'EOF'\n"
        "import os\n"
        "paths = [f'/workspace/f{i}' for i in range(200)]\n"
        "while True:\n"
        "    for p in paths:\n"
        "        try: os.unlink(p)\n"
        "        except OSError: pass\n"
        "        open(p, 'w').close(); os.unlink(p); os.mkfifo(p)\n"
        "EOF\n"
        "nohup python3 /tmp/swap.py >/dev/null 2>&1 & sleep 0.5; mkfifo /workspace/plain-fifo; echo swapping"
    )
    assert host.exec(handle, act(1, swapper)).exit_code == 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hashes = [pool.submit(host.workspace_hash, handle).result(timeout=120) for _ in range(3)]
    assert len(set(hashes)) == 1, hashes  # frozen: every pass reads the same tree
