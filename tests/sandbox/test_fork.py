"""Forks of a live sandbox on real podman + CRIU (belayer/sandbox/fork_archive.py, SandboxHost.fork).

One set-up sandbox (files, a shell state, a running server) is checkpointed and forked:
the forks start identical, share nothing writable, diverge on their own, refuse their
parent's steps, recover alone, and leave nothing behind (the `sandboxes` fixture checks).
"""

from __future__ import annotations

import pytest

from belayer.sandbox.errors import CheckpointCorrupt, SupervisorRefused
from belayer.sandbox.models import Action, ForkTarget, LoggedAction

SETUP = [
    "mkdir -p /workspace/repo && cd /workspace/repo && echo 'v1' > VERSION && export BUILD=7",
    "python3 -m http.server 8124 --bind 127.0.0.1 --directory /workspace/repo >/tmp/http.log 2>&1 &\n"
    "for i in $(seq 100); do python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8124/')\" "
    "2>/dev/null && break; sleep 0.1; done",
]
FETCH = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8124/VERSION').read().decode())\""
PROCESSES = "ps -eo pid=,args= | grep -e supervisor -e http.server | grep -v grep"


def targets(n: int, token: str) -> list[ForkTarget]:
    return [ForkTarget(sandbox_id=f"sbx-fork{i}-{token[:8]}", trajectory=f"member-{i}") for i in range(n)]


def test_forks_start_identical_and_diverge_alone(sandboxes):
    host = sandboxes.host
    parent = sandboxes.create(*SETUP)
    origin = host.checkpoint(parent)
    outcomes = host.fork(origin, targets(3, sandboxes.token))
    assert all(o.handle for o in outcomes), [o.error for o in outcomes]
    forks = [o.handle for o in outcomes]

    hashes = {host.workspace_hash(h) for h in forks} | {host.workspace_hash(parent)}
    assert len(hashes) == 1
    first = [host.exec(h, Action(trajectory=f"member-{i}", step=1, command=f"{PROCESSES}; pwd; echo $BUILD"))
             for i, h in enumerate(forks)]  # fmt: skip
    assert len({o.stdout for o in first}) == 1 and "http.server 8124" in first[0].stdout
    assert first[0].stdout.endswith("/workspace/repo\n7\n")  # the shell state came along
    names = [host.exec(h, Action(trajectory=f"member-{i}", step=2, command="hostname; cat /etc/hostname"))
             for i, h in enumerate(forks)]  # fmt: skip
    assert [o.stdout.split() for o in names] == [[h.sandbox_id, h.sandbox_id] for h in forks]

    # Each fork writes its own file, and its own server serves it: nothing is shared.
    for i, h in enumerate(forks):
        host.exec(h, Action(trajectory=f"member-{i}", step=3, command=f"echo v-fork{i} > VERSION"))
    for i, h in enumerate(forks):
        assert (
            host.exec(h, Action(trajectory=f"member-{i}", step=4, command=FETCH)).stdout == f"v-fork{i}\n\n"
        )
    host.exec(forks[0], Action(trajectory="member-0", step=5, command="pkill -f http.server; sleep 0.2"))
    assert host.exec(forks[1], Action(trajectory="member-1", step=5, command=FETCH)).stdout == "v-fork1\n\n"
    assert host.exec(parent, Action(trajectory="parent", step=1, command=FETCH)).stdout == "v1\n\n"
    assert len({host.workspace_hash(h) for h in forks}) == 3


def test_a_forks_journal_refuses_its_parents_steps(sandboxes):
    host = sandboxes.host
    parent = sandboxes.create()
    done = host.exec(parent, Action(trajectory="parent", step=1, command="echo a > /workspace/a"))
    ref = host.checkpoint(parent)
    log = [
        LoggedAction(
            trajectory="child", step=1, command="echo a > /workspace/a", observation_sha256=done.sha256
        )
    ]
    [fork] = host.fork(
        ref, [ForkTarget(sandbox_id=f"sbx-child-{sandboxes.token[:8]}", trajectory="child")], log=log
    )
    assert fork.handle is not None, fork.error
    again = host.exec(fork.handle, Action(trajectory="child", step=1, command="echo ran > /workspace/ran"))
    assert again.replayed_from_journal and again.sha256 == done.sha256  # inherited, not run twice
    for step in (1, 2):
        with pytest.raises(SupervisorRefused, match="belongs to trajectory 'child'"):
            host.exec(fork.handle, Action(trajectory="parent", step=step, command="true"))
    assert host.exec(fork.handle, Action(trajectory="child", step=2, command="ls /workspace")).stdout == "a\n"


def test_a_killed_fork_recovers_alone_from_its_own_checkpoint_then_its_origin(sandboxes):
    host = sandboxes.host
    parent = sandboxes.create(*SETUP)
    origin = host.checkpoint(parent)
    host.destroy(parent)
    a, b = (o.handle for o in host.fork(origin, targets(2, sandboxes.token)))
    log = []
    for step, command in enumerate(["echo one > one", "echo two > two"], start=1):
        obs = host.exec(a, Action(trajectory="member-0", step=step, command=command))
        log.append(
            LoggedAction(trajectory="member-0", step=step, command=command, observation_sha256=obs.sha256)
        )
        if step == 1:
            own = host.checkpoint(a)
    host.kill(a)

    outcome = host.recover(a, [own, origin], log, trajectory="member-0")
    assert outcome.source == "checkpoint@1" and outcome.consistent and outcome.replayed_steps == 1, outcome
    assert host.exec(b, Action(trajectory="member-1", step=1, command=FETCH)).stdout == "v1\n\n"  # untouched

    host.kill(outcome.handle)
    host.store.delete(host.load_meta(own).archive_key)
    again = host.recover(outcome.handle, [own, origin], log, trajectory="member-0")
    assert again.source == "checkpoint@0" and again.consistent and again.replayed_steps == 2, again
    probe = host.exec(again.handle, Action(trajectory="member-0", step=3, command=f"hostname; ls; {FETCH}"))
    assert probe.stdout == f"{a.sandbox_id}\nVERSION\none\ntwo\nv1\n\n"


def test_a_corrupt_origin_forks_nothing(sandboxes):
    host = sandboxes.host
    parent = sandboxes.create()
    ref = host.checkpoint(parent)
    host.store.put_bytes(host.load_meta(ref).archive_key, b"not an archive")
    with pytest.raises(CheckpointCorrupt):
        host.fork(ref, targets(2, sandboxes.token))
    assert set(sandboxes.backend.lineages()) >= {parent.sandbox_id}
    assert not any(
        sid.startswith("sbx-fork") and sandboxes.token[:8] in sid for sid in sandboxes.backend.lineages()
    )


# A loopback echo server and a client holding an established connection to it, which
# answers through that connection when /tmp/ask appears (tests/sandbox/test_sandbox.py's).
HELD_CONNECTION = [
    "cat > /tmp/echo.py <<'PY'\n"
    "import socket, threading\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 8126)); s.listen()\n"
    "def serve(conn):\n"
    "    f = conn.makefile('rw')\n"
    "    for line in f:\n"
    "        f.write('echo ' + line); f.flush()\n"
    "while True:\n"
    "    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()\n"
    "PY\n"
    "cat > /tmp/client.py <<'PY'\n"
    "import os, socket, time\n"
    "f = socket.create_connection(('127.0.0.1', 8126)).makefile('rw')\n"
    "while not os.path.exists('/tmp/ask'):\n"
    "    time.sleep(0.05)\n"
    "try:\n"
    "    f.write('ping\\n'); f.flush(); answer = f.readline() or 'closed\\n'\n"
    "except OSError as exc:\n"
    "    answer = type(exc).__name__ + '\\n'\n"
    "open('/tmp/answer', 'w').write(answer)\n"
    "PY\n"
    "python3 /tmp/echo.py >/dev/null 2>&1 & sleep 0.3; python3 /tmp/client.py >/dev/null 2>&1 &\n"
    "for i in $(seq 100); do grep -q ' 01 ' /proc/net/tcp && break; sleep 0.1; done; echo connected",
]
ASK = "touch /tmp/ask; for i in $(seq 100); do [ -s /tmp/answer ] && break; sleep 0.1; done; cat /tmp/answer"
NEW_CONNECTION = (
    "python3 -c \"import socket; f = socket.create_connection(('127.0.0.1', 8126)).makefile('rw'); "
    "f.write('again\\n'); f.flush(); print(f.readline(), end='')\""
)


def test_a_checkpoint_holding_an_established_connection_forks_with_it_closed(sandboxes):
    """Two forks of one connection cannot both own it: each fork starts with its established
    TCP connections closed (its client sees a reset, as after a network blip), the count is
    in its outcome, listeners and everything else come along, and the parent keeps its own."""
    host = sandboxes.host
    parent = sandboxes.create(*HELD_CONNECTION)
    origin = host.checkpoint(parent)
    outcomes = host.fork(origin, targets(2, sandboxes.token))
    assert all(o.handle for o in outcomes), [o.error for o in outcomes]
    # both ends of the one loopback connection were established sockets
    assert [o.closed_tcp_connections for o in outcomes] == [2, 2]
    for i, outcome in enumerate(outcomes):
        member = f"member-{i}"
        answer = host.exec(outcome.handle, Action(trajectory=member, step=1, command=ASK))
        assert answer.stdout in ("closed\n", "ConnectionResetError\n", "BrokenPipeError\n"), answer
        again = host.exec(outcome.handle, Action(trajectory=member, step=2, command=NEW_CONNECTION))
        assert again.stdout == "echo again\n", again  # the restored listener serves new connections
    assert host.exec(parent, Action(trajectory="parent", step=1, command=ASK)).stdout == "echo ping\n"


def test_a_fork_that_closed_connections_keeps_its_own_later_ones_through_a_restore(sandboxes):
    """Closing is for the fork's start only: a connection the fork opens afterwards survives
    the fork's own checkpoint and restore, as any sandbox's does."""
    host = sandboxes.host
    parent = sandboxes.create(*HELD_CONNECTION)
    (outcome,) = host.fork(host.checkpoint(parent), targets(1, sandboxes.token))
    fork, member = outcome.handle, "member-0"
    log = []
    # The parent's client came along with its connection closed: it would answer the next
    # ASK too (BrokenPipeError), racing the new client's answer. It goes first.
    reconnect = (
        "pkill -f /tmp/client.py; rm -f /tmp/ask /tmp/answer; python3 /tmp/client.py >/dev/null 2>&1 &\n"
        "for i in $(seq 100); do grep -q ' 01 ' /proc/net/tcp && break; sleep 0.1; done; echo connected"
    )
    for step, command in enumerate([reconnect], 1):
        observed = host.exec(fork, Action(trajectory=member, step=step, command=command))
        assert observed.exit_code == 0, observed
        log.append(
            LoggedAction(trajectory=member, step=step, command=command, observation_sha256=observed.sha256)
        )
    ref = host.checkpoint(fork)
    host.kill(fork)
    recovered = host.recover(fork, [ref], log, trajectory=member)
    assert recovered.consistent and recovered.source == f"checkpoint@{len(log)}", recovered
    asked = host.exec(recovered.handle, Action(trajectory=member, step=len(log) + 1, command=ASK))
    assert asked.stdout == "echo ping\n", asked


def test_a_host_forks_the_same_checkpoint_again_from_its_cached_archive(sandboxes, monkeypatch):
    """A training run forks a group's set-up checkpoint again every iteration: the host
    downloads and unpacks it once, the next forks there start from its cached copy (as
    identical as the first), a capture over the staging budget evicts that copy first,
    and a copy no fork could start from is dropped."""
    host = sandboxes.host
    parent = sandboxes.create(*SETUP)
    origin = host.checkpoint(parent)
    downloads = []
    original = host._download_archive
    monkeypatch.setattr(
        host, "_download_archive", lambda meta, f: (downloads.append(meta), original(meta, f))[1]
    )
    first = host.fork(origin, targets(1, sandboxes.token))
    again = host.fork(
        origin, [ForkTarget(sandbox_id=f"sbx-again-{sandboxes.token[:8]}", trajectory="member-9")]
    )
    assert all(o.handle for o in first + again), [o.error for o in first + again]
    assert (len(downloads), host.staging.cache_hits) == (1, 1)
    assert host.workspace_hash(first[0].handle) == host.workspace_hash(again[0].handle)
    cached = host.staging.usage().cached_bytes
    assert cached > 0 and list(host.staging.imports_dir.iterdir()) == []  # only the cache stays

    host.staging.budget_bytes = cached  # at the budget: the next capture makes room
    host.capture_checkpoint(parent)
    assert host.staging.usage().cached_bytes == 0 and host.staging.evicted == 1
    host.staging.budget_bytes = 1 << 30

    host.fork(origin, [ForkTarget(sandbox_id=f"sbx-third-{sandboxes.token[:8]}", trajectory="member-8")])
    assert len(downloads) == 2  # evicted, so downloaded again
    with open(next(host.staging.cache_dir.iterdir()), "r+b") as f:  # the cached copy damaged on disk
        f.truncate(1024)
    broken = host.fork(origin, [ForkTarget(sandbox_id=f"sbx-fourth-{sandboxes.token[:8]}", trajectory="m")])
    assert broken[0].handle is None and host.staging.usage().cached_bytes == 0  # dropped, not used twice
