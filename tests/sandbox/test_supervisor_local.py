"""The in-sandbox supervisor run as a local process (BELAYER_SUPERVISOR_LOCAL=1): no podman.

Covers the protocol, exactly-once journal, generations, timeouts, the output cap and
shell respawn quickly; tests/sandbox/test_sandbox.py repeats what matters inside real
containers. The supervisor and every process it started are killed after each test.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from belayer.sandbox import channel
from belayer.sandbox.errors import SandboxBusy, StaleGeneration, SupervisorRefused
from belayer.sandbox.models import Observation
from tests.tiers import needs

SUPERVISOR = Path(__file__).resolve().parents[2] / "infra/sandbox/supervisor.py"


def load_supervisor_module():
    spec = importlib.util.spec_from_file_location("belayer_supervisor", SUPERVISOR)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Local:
    def __init__(self, root: Path):
        self.root = root
        for d in ("chan", "journal", "ws"):
            (root / d).mkdir()
        env = dict(os.environ, BELAYER_SUPERVISOR_LOCAL="1", BELAYER_CHANNEL_DIR=str(root / "chan"),
                   BELAYER_JOURNAL_DIR=str(root / "journal"), BELAYER_WORKSPACE=str(root / "ws"))  # fmt: skip
        self.proc = subprocess.Popen([sys.executable, str(SUPERVISOR)], env=env, stderr=subprocess.DEVNULL,
                                     start_new_session=True)  # fmt: skip
        self.sock = root / "chan" / "supervisor.sock"
        channel.wait_ready(self.sock, 10)

    def run(self, step: int, command: str, timeout_s: float = 10, cap: int = 4096, generation: int = 0,
            trajectory: str = "t") -> Observation:  # fmt: skip
        reply = channel.run_action(self.sock, trajectory=trajectory, step=step, generation=generation,
                                   command=command, timeout_s=timeout_s, output_cap=cap, poll_s=0.5)  # fmt: skip
        return Observation.from_supervisor(reply["observation"], replayed=reply["replayed"])

    def descendants(self) -> list[int]:
        parents = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = Path(f"/proc/{name}/stat").read_bytes()
                except OSError:
                    continue
                parents[int(name)] = int(stat[stat.rfind(b")") + 2 :].split()[1])
        found, frontier = [], [self.proc.pid]
        while frontier:
            kids = [p for p, pp in parents.items() if pp in frontier]
            found += kids
            frontier = kids
        return found

    def stop(self) -> None:
        # The supervisor is a subreaper locally: every process it started is a descendant.
        for pid in self.descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
@needs("stack")
def sup(tmp_path):
    s = Local(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def test_shell_state_persists_and_ids_run_once(sup):
    assert sup.run(1, "cd /tmp && export A=1 && b=2 && f() { echo f$1; }").exit_code == 0
    obs = sup.run(2, "pwd; echo $A $b; f x; echo side-effect >> $OLDPWD/marker")
    assert obs.stdout == "/tmp\n1 2\nfx\n"
    again = sup.run(2, "echo something else")
    assert again.replayed_from_journal and again.sha256 == obs.sha256
    assert (sup.root / "ws" / "marker").read_text() == "side-effect\n"


def test_generation_and_order_are_enforced(sup):
    sup.run(1, "true")
    with pytest.raises(StaleGeneration):
        sup.run(2, "true", generation=1)
    channel.call(sup.sock, {"op": "set_generation", "expected": 0, "new": 3})
    with pytest.raises(StaleGeneration):
        sup.run(2, "true", generation=0)
    assert sup.run(2, "echo ok", generation=3).stdout == "ok\n"
    with pytest.raises(SupervisorRefused):  # a step at or before the head that never ran
        channel.call(
            sup.sock, {"op": "submit", "trajectory": "t", "step": 0, "generation": 3, "command": "true"}
        )
    with pytest.raises(SupervisorRefused):  # another trajectory
        sup.run(9, "true", generation=3, trajectory="other")


def test_busy_while_an_action_runs(sup):
    channel.call(sup.sock, {"op": "submit", "trajectory": "t", "step": 1, "generation": 0,
                            "command": "sleep 2", "timeout_s": 10})  # fmt: skip
    with pytest.raises(SandboxBusy):
        channel.call(
            sup.sock, {"op": "submit", "trajectory": "t", "step": 2, "generation": 0, "command": "true"}
        )
    # A retry of the running id attaches to it instead of running it twice.
    reply = channel.call(sup.sock, {"op": "submit", "trajectory": "t", "step": 1, "generation": 0,
                                    "command": "sleep 2", "wait_s": 5})  # fmt: skip
    assert reply["state"] == "done" and reply["observation"]["exit_code"] == 0


def test_timeout_kills_the_action_not_the_shell(sup):
    sup.run(1, "export KEEP=1; sleep 30 >/dev/null 2>&1 &")
    obs = sup.run(2, "sleep 30", timeout_s=0.5)
    assert obs.timed_out and not obs.shell_respawned
    obs = sup.run(3, "while :; do :; done", timeout_s=0.5)
    assert obs.timed_out and obs.shell_respawned
    after = sup.run(4, "echo $KEEP; jobs | wc -l")
    assert after.stdout == "1\n0\n"  # exports kept, the job table is the new shell's


def test_exit_keeps_the_state_exec_loses_only_its_own(sup):
    sup.run(1, "cd /tmp; export X=y")
    obs = sup.run(2, "export X=z; exit 7")
    assert obs.exit_code == 7 and not obs.shell_respawned  # the EXIT trap still hands the state on
    assert sup.run(3, "pwd; echo $X").stdout == "/tmp\nz\n"
    obs = sup.run(4, "export X=lost; cd /; exec true")
    assert obs.exit_code == 0 and obs.shell_respawned and "action before" in obs.note
    assert sup.run(5, "pwd; echo $X").stdout == "/tmp\nz\n"


# What an agent defines to take over the plumbing: each line is one earlier action.
OVERRIDES = [
    "printf() { builtin printf 'forged\\n'; return 0; }",
    "eval() { return 0; }",
    "read() { return 1; }",
    "builtin() { exit 0; }",
    "declare() { exit 0; }; compgen() { exit 0; }; env() { exit 0; }",
    "test() { return 0; }; [() { return 0; }",
    "shopt -s expand_aliases; alias false=true; alias echo='echo forged'",
    "trap 'exit 0' EXIT; trap 'exit 0' ERR; trap 'false' DEBUG; shopt -s extdebug",
    "set -e -o pipefail; set -u",
    "export PATH=/tmp/fakebin:$PATH; mkdir -p /tmp/fakebin; printf '#!/bin/sh\\nexit 0\\n' > /tmp/fakebin/false; chmod +x /tmp/fakebin/false",
    "export BASH_ENV=/tmp/evil.sh SHELLOPTS=errexit POSIXLY_CORRECT=1; echo 'exit 0' > /tmp/evil.sh",
    "enable -n eval; enable -n exit; set +o posix; exit() { :; }",
    "readonly __belayer_rc=0 __belayer_action='exit 0'; export __belayer_exported=PATH",
    "echo $__belayer_nonce > /tmp/nonce",
]


def test_agent_definitions_never_reach_the_next_actions_plumbing(sup, tmp_path):
    # the supervisor runs on this host here: the agent's files go to the test's folder, not /tmp
    for step, override in enumerate(OVERRIDES, start=1):
        sup.run(step, override.replace("/tmp/", f"{tmp_path}/"))
    step = len(OVERRIDES)
    failed = sup.run(step + 1, "echo out; echo err >&2; false")
    assert failed.exit_code == 1 and failed.stdout == "out\n" and failed.stderr == "err\n", failed
    status = sup.run(step + 2, "(exit 3)")
    assert status.exit_code == 3
    # The agent's functions still work for the agent: it is their plumbing use that is cut.
    assert sup.run(step + 3, "printf x").stdout == "forged\n"
    # The sentinel's nonce never entered the sandbox.
    assert sup.run(step + 4, f"cat {tmp_path}/nonce; env | grep -ci nonce").stdout == "\n0\n"


def test_output_cap_keeps_head_and_tail(sup):
    obs = sup.run(1, "seq 1 200000", cap=1024)
    assert obs.truncated and obs.stdout.startswith("1\n2\n") and obs.stdout.endswith("199999\n200000\n")
    assert obs.stdout_bytes == len("".join(f"{i}\n" for i in range(1, 200001)))
    assert "bytes truncated" in obs.stdout


def test_capture_handles_split_sentinels():
    mod = load_supervisor_module()
    cap = mod.Capture("abcd", 100)
    data = b"hello \x1eab" + b"cd\x1e" + b"ignored"
    for i in range(len(data)):  # byte by byte: the sentinel arrives split
        if not cap.done.is_set():
            cap.feed(data[i : i + 1])
    assert cap.done.is_set()
    out = cap.finish()
    assert base64.b64decode(out["b64"]) == b"hello " and out["dropped"] == 0


def test_binary_and_large_commands(sup):
    obs = sup.run(1, "printf '\\xff\\x00ok'")
    assert obs.binary and obs.stdout == "\\xff\x00ok"
    big = "echo " + "x" * 200_000
    assert sup.run(2, big).stdout_bytes == 200_001
    assert sup.run(3, "echo é; echo 'multi\nline'").stdout == "é\nmulti\nline\n"


def test_journal_compaction_keeps_hashes(tmp_path, monkeypatch):
    monkeypatch.setenv("BELAYER_SUPERVISOR_LOCAL", "1")
    mod = load_supervisor_module()
    j = mod.Journal(str(tmp_path))
    for step in range(1, 41):
        out = base64.b64encode(f"out {step}\n".encode()).decode()
        obs = {"exit_code": 0, "sha256": mod.observation_hash(0, out, "", False), "timed_out": False,
               "stdout": {"b64": out, "total": 6, "dropped": 0}, "stderr": {"b64": "", "total": 0, "dropped": 0},
               "duration_s": 0.0, "shell_respawned": False, "note": ""}  # fmt: skip
        j.append({"type": "action", "trajectory": "t", "step": step, "generation": 0, "observation": obs})
    full = {k: Observation.from_supervisor(v, replayed=True).sha256 for k, v in j.entries.items()}
    j._compact(keep_full=5)
    again = mod.Journal(str(tmp_path))  # what a restarted supervisor would read
    assert again.head("t") == 40
    for key, obs in again.entries.items():
        o = Observation.from_supervisor(obs, replayed=True)
        assert o.sha256 == full[key]
        assert bool(obs.get("compacted")) == (key[1] <= 35)


def test_a_fork_answers_its_inherited_steps_as_its_own_and_refuses_the_parents(sup):
    first = sup.run(1, "echo one > f; cat f", trajectory="parent")
    sup.run(2, "echo two >> f", trajectory="parent")
    with pytest.raises(SupervisorRefused, match="fork serves a trajectory"):
        channel.call(sup.sock, {"op": "fork", "expected": 0, "new": 4, "trajectory": "__setup__"})
    with pytest.raises(StaleGeneration):
        channel.call(sup.sock, {"op": "fork", "expected": 3, "new": 4, "trajectory": "child"})
    info = channel.call(sup.sock, {"op": "fork", "expected": 0, "new": 4, "trajectory": "child"})
    assert (info["generation"], info["trajectory"], info["head"]) == (4, "child", 2)
    inherited = sup.run(1, "never runs", generation=4, trajectory="child")
    assert inherited.replayed_from_journal and inherited.sha256 == first.sha256
    assert sup.run(3, "cat f", generation=4, trajectory="child").stdout == "one\ntwo\n"
    for step in (1, 4):  # the parent's steps, inherited or new, are foreign now
        with pytest.raises(SupervisorRefused, match="belongs to trajectory 'child'"):
            sup.run(step, "true", generation=4, trajectory="parent")


def test_a_forks_identity_survives_a_restart_and_compaction(tmp_path, monkeypatch):
    monkeypatch.setenv("BELAYER_SUPERVISOR_LOCAL", "1")
    mod = load_supervisor_module()
    j = mod.Journal(str(tmp_path))
    j.append({"type": "fork", "trajectory": "child", "generation": 2})  # forked before any step
    assert (mod.Journal(str(tmp_path)).trajectory, mod.Journal(str(tmp_path)).generation) == ("child", 2)
    j._compact()
    again = mod.Journal(str(tmp_path))
    assert (again.trajectory, again.generation, again.head("child")) == ("child", 2, 0)
