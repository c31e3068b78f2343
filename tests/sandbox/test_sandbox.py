"""Real sandboxes on podman + runc + CRIU: checkpoint, restore, recover, exactly-once, bad input.

ZDTM style: the same scenario runs with no checkpoint, with checkpoint -> kill ->
restore on a fresh container, with iterated checkpoints, and with a checkpoint that
leaves the sandbox running; each mode checks the same visible state (shell cwd,
exported and unexported variables, the job table, a background HTTP server's answer,
the /workspace tree hash). Every sandbox is removed by the `sandboxes` fixture.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from belayer.sandbox.errors import StaleGeneration
from belayer.sandbox.models import Action, LoggedAction, SandboxHandle
from belayer.sandbox.runtime import CRIU_CONFIG, podman_dirs

TRAJ = "traj-test"

SCENARIO = [
    "mkdir -p /workspace/proj && cd /workspace/proj && export APP_MODE=test && echo 'print(6*7)' > calc.py",
    # A background server the agent starts and later queries.
    "python3 -m http.server 8123 --bind 127.0.0.1 >/tmp/http.log 2>&1 &\n"
    "for i in $(seq 100); do python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8123/')\" "
    "2>/dev/null && break; sleep 0.1; done; echo up",
    "python3 calc.py > out.txt && counter=7 && greet() { echo hello-$1; } && export COUNTER=1",
    "mkdir -p sub && cd sub && export COUNTER=$((COUNTER+1)) && echo data > here.txt && pwd",
    "greet $counter; ls -R /workspace",
]
PROBE = (
    "pwd; echo $APP_MODE $COUNTER $counter; greet x; "
    "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/out.txt').read().decode())\""
)
PROBE_EXPECTED = "/workspace/proj/sub\ntest 2 7\nhello-x\n42\n\n"


def act(step: int, command: str, timeout_s: float | None = None) -> Action:
    return Action(trajectory=TRAJ, step=step, command=command, timeout_s=timeout_s)


def run_logged(host, handle: SandboxHandle, steps: range, log: list[LoggedAction]) -> None:
    for step in steps:
        obs = host.exec(handle, act(step, SCENARIO[step - 1]))
        assert obs.exit_code == 0, (step, obs)
        log.append(LoggedAction(trajectory=TRAJ, step=step, command=SCENARIO[step - 1],
                                observation_sha256=obs.sha256))  # fmt: skip


@pytest.mark.parametrize("mode", ["none", "checkpoint", "iterated", "leave-running", "chained"])
def test_zdtm_shell_state_and_server_survive(sandboxes, mode):
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    n = len(SCENARIO)
    checkpoints = []
    if mode == "none":
        run_logged(host, handle, range(1, n + 1), log)
    elif mode in ("checkpoint", "leave-running"):
        run_logged(host, handle, range(1, 3), log)
        checkpoints.append(host.checkpoint(handle))
        run_logged(host, handle, range(3, n + 1), log)
    elif mode == "chained":  # restore, then checkpoint the restored sandbox and restore again
        run_logged(host, handle, range(1, 3), log)
        first = host.checkpoint(handle)
        host.kill(handle)
        handle = host.recover(handle, [first], log).handle
        run_logged(host, handle, range(3, 4), log)
        checkpoints.insert(0, host.checkpoint(handle))
        run_logged(host, handle, range(4, n + 1), log)
    else:  # iterated: a checkpoint after every step from 2 on
        for step in range(1, n + 1):
            run_logged(host, handle, range(step, step + 1), log)
            if step >= 2:
                checkpoints.insert(0, host.checkpoint(handle))
    before_hash = host.workspace_hash(handle)

    if mode in ("checkpoint", "iterated", "chained"):
        # The sandbox dies, and everything this host had for it goes: a fresh host.
        host.kill(handle)
        sandboxes.backend.destroy(handle.sandbox_id)
        outcome = host.recover(handle, checkpoints, log)
        assert outcome.consistent, outcome
        assert outcome.consistent_at == n
        assert outcome.source == f"checkpoint@{checkpoints[0].step}"
        assert outcome.handle.generation == handle.generation + 1 == (2 if mode == "chained" else 1)
        assert outcome.replayed_steps == n - checkpoints[0].step
        handle = outcome.handle

    probe = host.exec(handle, act(n + 1, PROBE))
    assert probe.exit_code == 0, probe
    assert probe.stdout == PROBE_EXPECTED
    assert host.workspace_hash(handle) == before_hash


TCP_SCENARIO = [
    # An echo server and a client that holds one loopback connection open until asked.
    "cat > /tmp/echo.py <<'PY'\n"
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 8125)); s.listen()\n"
    "conn, _ = s.accept(); f = conn.makefile('rw')\n"
    "for line in f:\n"
    "    f.write('echo ' + line); f.flush()\n"
    "PY\n"
    "cat > /tmp/client.py <<'PY'\n"
    "import os, socket, time\n"
    "f = socket.create_connection(('127.0.0.1', 8125)).makefile('rw')\n"
    "while not os.path.exists('/tmp/ask'):\n"
    "    time.sleep(0.05)\n"
    "f.write('ping\\n'); f.flush(); open('/tmp/answer', 'w').write(f.readline())\n"
    "PY\n"
    "echo written",
    "python3 /tmp/echo.py >/dev/null 2>&1 & sleep 0.3; python3 /tmp/client.py >/dev/null 2>&1 &\n"
    "for i in $(seq 100); do grep -q ' 01 ' /proc/net/tcp && break; sleep 0.1; done; echo connected",
]


@pytest.mark.parametrize("after_checkpoint", ["restored", "left running"])
def test_established_tcp_connection_survives_a_checkpoint(sandboxes, after_checkpoint):
    """A checkpoint holding an established loopback connection restores with
    `--tcp-established` (podman then refuses `--name`: renamed afterwards), and the
    connection carries data after the restore; so does the one the dump left running. CRIU
    takes neither without locking the network (infra/podman/criu.conf)."""
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    for step, command in enumerate(TCP_SCENARIO, 1):
        obs = host.exec(handle, act(step, command))
        assert obs.exit_code == 0, obs
        log.append(LoggedAction(trajectory=TRAJ, step=step, command=command, observation_sha256=obs.sha256))
    ref = host.checkpoint(handle)
    if after_checkpoint == "restored":
        host.kill(handle)
        outcome = host.recover(handle, [ref], log)
        assert outcome.source == f"checkpoint@{len(TCP_SCENARIO)}" and outcome.consistent, outcome
        assert outcome.handle.container == sandboxes.backend.container_name(handle.sandbox_id, 1)
        handle = outcome.handle
    answer = host.exec(
        handle,
        act(
            len(TCP_SCENARIO) + 1,
            (
                "touch /tmp/ask; for i in $(seq 100); do [ -s /tmp/answer ] && break; sleep 0.1; done; cat /tmp/answer"
            ),
        ),
    )
    assert answer.stdout == "echo ping\n", answer


def test_criu_reads_belayers_configuration_before_and_after_a_restore(sandboxes, tmp_path):
    """Every sandbox names infra/podman/criu.conf to CRIU (`org.criu.config`), and so does
    the container restored from its checkpoint: CRIU's own dump log says it parsed it."""
    host, backend = sandboxes.host, sandboxes.backend
    assert "network-lock skip" in CRIU_CONFIG.read_text()
    handle = sandboxes.create()
    command = "echo state > /workspace/f"
    observation = host.exec(handle, act(1, command))
    log = [LoggedAction(trajectory=TRAJ, step=1, command=command, observation_sha256=observation.sha256)]
    first = _criu_dump_log(backend, handle.container, tmp_path / "first.tar")
    ref = host.checkpoint(handle)
    host.kill(handle)
    restored = host.recover(handle, [ref], log).handle
    again = _criu_dump_log(backend, restored.container, tmp_path / "again.tar")
    for dump_log in (first, again):
        assert f"Parsing config file {CRIU_CONFIG}" in dump_log, dump_log[:2000]


def _criu_dump_log(backend, container: str, export: Path) -> str:
    """CRIU's log of a dump of `container` that leaves it running (`--keep` keeps the log)."""
    stats = backend.podman("container", "checkpoint", "--leave-running", "--keep", "--print-stats", "-c", "none",
                           f"--export={export}", container).stdout  # fmt: skip
    container_id = json.loads(stats)["container_statistics"][0]["Id"]
    root = podman_dirs(backend.state_dir)["root"]
    return (root / "overlay-containers" / container_id / "userdata" / "dump.log").read_text()


def test_repeated_action_id_executes_once(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    first = host.exec(handle, act(1, "echo line >> /workspace/count; wc -l < /workspace/count"))
    again = host.exec(handle, act(1, "echo line >> /workspace/count; wc -l < /workspace/count"))
    assert first.stdout == "1\n" and not first.replayed_from_journal
    assert again.replayed_from_journal and again.sha256 == first.sha256
    check = host.exec(handle, act(2, "wc -l < /workspace/count"))
    assert check.stdout == "1\n"


def test_stale_generation_refused(sandboxes):
    host = sandboxes.host
    old = sandboxes.create()
    obs = host.exec(old, act(1, "echo one"))
    ref = host.checkpoint(old)
    log = [LoggedAction(trajectory=TRAJ, step=1, command="echo one", observation_sha256=obs.sha256)]
    new = host.recover(old, [ref], log).handle
    assert new.generation == old.generation + 1
    with pytest.raises(StaleGeneration):
        host.exec(old, act(2, "echo should-not-run"))
    with pytest.raises(StaleGeneration):
        host.checkpoint(old)
    assert host.exec(new, act(2, "echo two")).stdout == "two\n"


def test_corrupt_archive_falls_back_to_previous_then_replay(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    run_logged(host, handle, range(1, 3), log)
    older = host.checkpoint(handle)
    run_logged(host, handle, range(3, 5), log)
    newer = host.checkpoint(handle)
    run_logged(host, handle, range(5, 6), log)
    meta = host.load_meta(newer)
    host.store.put_bytes(meta.archive_key, b"garbage, not a checkpoint")  # a corrupt object
    host.kill(handle)

    outcome = host.recover(handle, [newer, older], log)
    assert outcome.source == f"checkpoint@{older.step}" and outcome.consistent, outcome
    assert any("unusable" in n and meta.archive_key in n for n in outcome.notes)

    # Both archives gone: replay from the start in a fresh sandbox, and say so.
    host.store.delete(host.load_meta(older).archive_key)
    host.kill(outcome.handle)
    outcome2 = host.recover(outcome.handle, [newer, older], log)
    assert outcome2.source == "replay-from-start", outcome2
    assert outcome2.consistent and outcome2.replayed_steps == len(log)
    assert any("replay from the start" in n for n in outcome2.notes)
    probe = host.exec(outcome2.handle, act(6, PROBE))
    assert probe.stdout == PROBE_EXPECTED


def test_recover_reports_first_mismatch(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    commands = ["echo stable > /workspace/a", "cat /proc/sys/kernel/random/uuid", "echo never-reached"]
    log = []
    for i, c in enumerate(commands, start=1):
        obs = host.exec(handle, act(i, c))
        log.append(LoggedAction(trajectory=TRAJ, step=i, command=c, observation_sha256=obs.sha256))
    ref = host.checkpoint(handle)  # at step 3
    del ref
    host.kill(handle)
    outcome = host.recover(handle, [], log, mode="replay")
    assert not outcome.consistent
    assert outcome.mismatch_step == 2 and outcome.consistent_at == 1
    assert outcome.mismatch_observation is not None and len(outcome.mismatch_observation.stdout) == 37
    assert outcome.replayed_steps == 2  # stops at the first mismatch


# ------------------------------------------------------------------------- bad input


def test_never_ending_command_times_out_and_sandbox_stays_usable(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    host.exec(handle, act(1, "cd /workspace; export KEEP=yes; sleep 1000 >/dev/null 2>&1 & echo bg"))
    obs = host.exec(handle, act(2, "sleep 1000", timeout_s=1))
    assert obs.timed_out and obs.exit_code != 0 and not obs.shell_respawned
    # A shell stuck in a builtin loop is killed; the state of the action before is kept.
    obs = host.exec(handle, act(3, "cd /tmp; export KEEP=still; while :; do :; done", timeout_s=1))
    assert obs.timed_out and obs.shell_respawned and "action before" in obs.note
    after = host.exec(handle, act(4, "pwd; echo $KEEP; pgrep -c sleep"))
    assert after.stdout == "/workspace\nyes\n1\n", after  # the earlier background job survived


def test_huge_output_is_capped(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    obs = host.exec(
        handle, act(1, "head -c 1000000000 /dev/zero | tr '\\0' y; echo; echo tail-end", timeout_s=120)
    )
    assert obs.exit_code == 0
    assert obs.stdout_bytes == 1_000_000_000 + len("\ntail-end\n")
    assert obs.truncated and "bytes truncated" in obs.stdout
    assert len(obs.stdout) < 2 * host.cfg.output_cap_bytes
    assert obs.stdout.endswith("tail-end\n")


@pytest.mark.sandbox_config(pids_limit=64)
def test_fork_bomb_hits_pids_limit(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    # In the foreground: the timeout freezes and kills every process the action started.
    obs = host.exec(handle, act(1, "bomb() { bomb | bomb; }; bomb", timeout_s=3))
    assert obs.timed_out
    after = host.exec(
        handle,
        act(2, "echo alive; cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max"),
    )
    assert after.stdout == "alive\n64\n", after
    # In the background it outlives its action; the pids limit contains it, the supervisor
    # still answers, and the next action's observation says what happened.
    host.exec(handle, act(3, "bomb() { bomb | bomb & }; bomb; sleep 2; echo started", timeout_s=10))
    starved = host.exec(handle, act(4, "echo hello; /bin/true", timeout_s=5))
    # Whether the bomb still holds every pid is a race: either the action ran, or its
    # observation names the exhausted limit (or the failed fork) -- never a dead channel.
    assert starved.stdout.startswith("hello") or "process limit" in starved.note or starved.timed_out, starved
    assert host.ping(handle)["ok"]


def test_filling_the_disk_fails_cleanly(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    mb = host.cfg.workspace_mb
    obs = host.exec(handle, act(1, f"head -c {(mb + 16)}M /dev/zero > /workspace/big"))
    assert obs.exit_code != 0 and "No space left on device" in obs.stderr, obs
    ro = host.exec(handle, act(2, "echo x > /usr/local/x; echo x > /var/cache/x"))
    assert ro.exit_code != 0 and "Read-only file system" in ro.stderr, ro
    ok = host.exec(handle, act(3, "rm /workspace/big && echo small > /workspace/f && cat /workspace/f"))
    assert ok.stdout == "small\n"


def test_network_is_loopback_only(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    probe = (
        "python3 - <<'EOF'\n"
        "import socket\n"
        "for addr in [('1.1.1.1', 80), ('10.0.2.2', 80)]:\n"
        "    s = socket.socket(); s.settimeout(3)\n"
        "    try:\n"
        "        s.connect(addr); print('REACHED', addr)\n"
        "    except OSError as e:\n"
        "        print('blocked', e.errno)\n"
        "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)\n"
        "c = socket.create_connection(srv.getsockname()); print('loopback ok')\n"
        "EOF\n"
        "ip -o link 2>/dev/null | wc -l; cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '"
    )
    obs = host.exec(handle, act(1, probe))
    assert "REACHED" not in obs.stdout and obs.stdout.count("blocked") == 2, obs
    assert "loopback ok" in obs.stdout
    assert obs.stdout.strip().endswith("lo"), obs  # the only interface


def test_binary_output_is_returned_safely(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    obs = host.exec(handle, act(1, "printf 'ok\\x00\\xff\\xfe\\x80end'; printf '\\xc3\\xa9' >&2"))
    assert obs.binary and obs.exit_code == 0
    assert obs.stdout == "ok\x00\\xff\\xfe\\x80end"
    assert obs.stderr == "é"
    assert obs.stdout_bytes == 9


def test_agent_cannot_reach_journal_channel_or_supervisor(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    cmds = [
        "cat /var/lib/belayer/journal.jsonl",
        "ls /run/belayer",
        "cat /proc/1/environ",
        "ls -l /proc/1/fd/ && cat /proc/1/fd/*",
        "kill -9 1",
        "kill -TERM 1",
        "grep CapEff /proc/self/status",
    ]
    outs = [host.exec(handle, act(i, c)) for i, c in enumerate(cmds, start=1)]
    for o in outs[:4]:
        assert o.exit_code != 0 and "Permission denied" in o.stderr, o
    assert outs[6].stdout.split()[1] == "0000000000000000"
    alive = host.exec(handle, act(len(cmds) + 1, "echo still-here"))
    assert alive.stdout == "still-here\n"


def test_fs_only_baseline_keeps_files_but_loses_processes(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    run_logged(host, handle, range(1, 4), log)
    ref = host.checkpoint(handle, fs_snapshot=True)
    run_logged(host, handle, range(4, len(SCENARIO) + 1), log)
    expected = host.workspace_hash(handle)
    host.kill(handle)
    outcome = host.recover(handle, [ref], log, mode="fs-only")
    assert outcome.source == "fs@3"
    # Step 4 runs `cd sub` relative to a cwd the new shell does not have: the first mismatch.
    assert not outcome.consistent and outcome.mismatch_step == 4, outcome
    files = host.exec(outcome.handle, act(len(SCENARIO) + 1, "cat /workspace/proj/out.txt"))
    assert files.stdout == "42\n"  # the files of step 3 came back
    assert host.workspace_hash(outcome.handle) != expected


def test_fault_damaged_archive_fails_restore_and_falls_back(sandboxes, monkeypatch):
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    run_logged(host, handle, range(1, 3), log)
    ref = host.checkpoint(handle)
    host.kill(handle)
    monkeypatch.setenv("BELAYER_FAULT", "sandbox_restore_damaged_archive")
    outcome = host.recover(handle, [ref], log)
    # The sha256 matched, podman/CRIU refused the bytes: replay from the start, said so.
    assert outcome.source == "replay-from-start" and outcome.consistent, outcome
    assert any("unusable" in n for n in outcome.notes)
    names = sandboxes.backend.containers_of(handle.sandbox_id)
    assert names == [outcome.handle.container]  # the failed restore left nothing behind


def test_fault_sandbox_killed_during_exec(sandboxes, monkeypatch):
    from belayer.sandbox.errors import SandboxUnreachable

    host = sandboxes.host
    handle = sandboxes.create()
    monkeypatch.setenv("BELAYER_FAULT", "sandbox_kill_during_exec")
    with pytest.raises(SandboxUnreachable):
        host.exec(handle, act(1, "sleep 5"))


def _nice_of(pid: int) -> int:
    """A running process's niceness, from /proc (field 19 of its stat line)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


@pytest.mark.sandbox_config(checkpoint_nice=7)
def test_checkpoint_runs_podman_and_criu_at_the_configured_niceness(sandboxes, monkeypatch):
    """A checkpoint overlaps the next generation: its podman (and the runc/CRIU it starts)
    runs `checkpoint_nice` above the worker, and the worker's own threads stay as they were."""
    host = sandboxes.host
    handle = sandboxes.create()
    obs = host.exec(handle, act(1, "echo one > /workspace/f"))
    seen: list[int] = []
    start_export = host.backend._start_export

    def watched(*args, **kwargs):
        export_args, procs, reader = start_export(*args, **kwargs)
        seen.extend(_nice_of(p.pid) for p in procs)
        return export_args, procs, reader

    monkeypatch.setattr(host.backend, "_start_export", watched)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    ref = host.checkpoint(handle)
    assert seen and all(n == min(19, before + 7) for n in seen), seen
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    log = [
        LoggedAction(
            trajectory=TRAJ, step=1, command="echo one > /workspace/f", observation_sha256=obs.sha256
        )
    ]
    restored = host.recover(handle, [ref], log).handle  # the checkpoint is whole: it restores
    assert host.exec(restored, act(2, "cat /workspace/f")).stdout == "one\n"
