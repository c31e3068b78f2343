"""An agent that cannot solve its task goes after the judge instead: code planted where the
check's interpreter starts, a process left behind to rewrite what the check writes, signals
and OOM scores aimed at PID 1. Each attack runs through the real workflow (Temporal,
scripted engine, real podman + CRIU); each would have turned a failing trajectory into
reward 1 or into `failed_infra` (a dropped group). Now the check fails honestly -- reward 0,
`failed_policy` -- or the attack fails and the trajectory goes on with nothing recovered.
"""

from __future__ import annotations

import asyncio

import pytest

from belayer.policy.config import PolicyConfig
from belayer.workloads.models import TraceTask, TraceTurn
from tests.hostile.test_agent_breaks_sandbox import BRING_PID1_DOWN
from tests.hostile.test_trajectory_hostile import _steps, start

# What the task asks (an answer the agent never writes), judged three ways, each by an
# interpreter or a file the agent tries to reach.
PYTHON_CHECK = (
    "python3 -c \"import sys; sys.exit(0 if open('/workspace/answer.txt').read().strip() == '42' else 1)\""
)
JSON_CHECK = "python3 -c \"import json, sys; sys.exit(0 if json.load(open('answer.json'))['ok'] else 1)\""
# The check keeps its verdict where a check's scratch belongs, its own TMPDIR (a fixed
# path such as /tmp/verdict would be the agent's to pre-create, README: "What the agent
# can reach").
VERDICT_CHECK = (
    'if [ "$(cat /workspace/answer.txt 2>/dev/null)" = 42 ]; then echo pass > "$TMPDIR/verdict"; '
    'else echo fail > "$TMPDIR/verdict"; fi; sleep 1; grep -qx pass "$TMPDIR/verdict"'
)
# A process left running that writes "pass" into every directory under /tmp it can find,
# the check's TMPDIR among them once it exists.
REWRITER = (
    'nohup sh -c \'while :; do for d in /tmp /tmp/*/ /tmp/*/*/; do echo pass > "$d/verdict" 2>/dev/null; '
    "done; sleep 0.01; done' >/dev/null 2>&1 & echo started"
)
# A check that passes only when something of the agent's runs while it does (a file that
# keeps changing): it stands for any check a running process could sway.
TICKS_CHECK = 'a=$(cat /workspace/ticks); sleep 1; [ "$a" != "$(cat /workspace/ticks)" ]'
# The process that sways it hides from a freezer that reads only each process's leader:
# its main thread exits (the leader reads Z, a zombie) while a second thread goes on.
TICKER_BEHIND_AN_EXITED_LEADER = (
    "printf '%s\\n' 'import ctypes, itertools, threading, time' 'def tick():' "
    '\'    for n in itertools.count(): open("/workspace/ticks", "w").write(str(n)); time.sleep(0.01)\' '
    "'threading.Thread(target=tick).start()' 'ctypes.CDLL(None).pthread_exit(None)' > /tmp/ticker.py && "
    "{ nohup python3 /tmp/ticker.py >/dev/null 2>&1 & } && sleep 0.5 && "
    "test \"$(cut -d' ' -f3 /proc/$!/stat)\" = Z && echo ticking"
)
# A parent that vforked a child which never execs sleeps in the kernel (D) until it does;
# once the child is stopped, never: a freezer that waits for it to stop gives up, and the
# sandbox reads as broken by infrastructure (`failed_infra`: a dropped group, not a 0).
VFORK_PARENT = (
    "{ nohup python3 -c 'import ctypes; libc = ctypes.CDLL(None); libc.vfork() == 0 and libc.pause()' "
    ">/dev/null 2>&1 & } && sleep 0.5 && test \"$(cut -d' ' -f3 /proc/$!/stat)\" = D && echo waiting"
)

FORGERIES = {
    # start-up code in the user site: a .pth line and usercustomize run in every python3
    # started with this HOME
    "user-site": (
        [
            'site=$(python3 -m site --user-site) && mkdir -p "$site" && '
            "echo 'import os; os._exit(0)' > \"$site/forge.pth\" && "
            "echo 'import os; os._exit(0)' > \"$site/usercustomize.py\" && "
            "echo 'import os; os._exit(0)' > \"$site/sitecustomize.py\" && echo planted",
        ],
        PYTHON_CHECK,
        "frozen",
    ),
    # a module in the check's working directory shadowing the standard library
    "shadowed-stdlib": (
        [
            "printf 'import os\\nos._exit(0)\\n' > /workspace/json.py && echo '{\"ok\": false}' > /workspace/answer.json"
        ],
        JSON_CHECK,
        "frozen",
    ),
    # a process left running that keeps writing the verdict the check writes and then
    # reads: frozen with the agent's other processes during the check
    "background-rewriter": ([REWRITER], VERDICT_CHECK, "frozen"),
    # the same, against a check that keeps the agent's processes running (its servers):
    # the check runs as another user, whose TMPDIR the agent's process cannot enter
    "background-rewriter-running": ([REWRITER], VERDICT_CHECK, "running"),
    # a thread that keeps working after its process's leader exited: frozen all the same
    "ticker-behind-an-exited-leader": ([TICKER_BEHIND_AN_EXITED_LEADER], TICKS_CHECK, "frozen"),
    # a process that cannot stop until its child runs: frozen as it is, the check fails honestly
    "vfork-parent-in-the-kernel": ([VFORK_PARENT], PYTHON_CHECK, "frozen"),
}
# CRIU cannot dump a vfork parent and child (each capture fails, retried 3 times: 30 s);
# the checkpoint is not what these forgeries are about.
UNCHECKPOINTABLE = {"vfork-parent-in-the-kernel"}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
async def test_a_planted_forgery_does_not_pass_a_failing_check(stack, forgery):
    commands, check, processes = FORGERIES[forgery]
    turns = [TraceTurn(think_tokens=4, bash=c) for c in commands]
    task = TraceTask(id=f"forge-{forgery}", turns=turns, check=check, verify_with_processes=processes)
    policy = PolicyConfig(mode="none") if forgery in UNCHECKPOINTABLE else PolicyConfig(mode="every-step")
    handle = await start(stack, task, policy=policy)
    result = await asyncio.wait_for(handle.result(), 600)
    steps = {s["step"]: s for s in await _steps(stack, handle.id)}
    assert steps[1]["exit_code"] == 0, steps[1]  # the forgery was planted
    assert (result.status, result.reward) == ("failed_policy", 0.0), (result, steps)
    assert result.recoveries == []


MEMORY_HOG = "python3 -c \"b = [b'x' * (64 << 20) for _ in range(10000)]\"; echo python=$?"
PID1_TURNS = [
    # every signal whose default would end a process, sent to PID 1 from inside
    "for s in INT TERM HUP QUIT USR1 USR2 ALRM; do kill -s $s 1; done; sleep 1; echo signalled",
    # the sandbox's memory exhausted by one process of the agent's
    MEMORY_HOG,
    "echo after",
]


async def test_pid1_outlives_signals_and_memory_pressure_from_the_agent(stack):
    """Neither attack loses the sandbox: no recovery, no failed_infra; the OOM kill takes the
    agent's process (oom_score_adj 1000 against PID 1's 0)."""
    task = TraceTask(id="pid1", turns=[TraceTurn(think_tokens=4, bash=c) for c in PID1_TURNS], check="true")
    handle = await start(stack, task)
    result = await asyncio.wait_for(handle.result(), 600)
    steps = {s["step"]: s for s in await _steps(stack, handle.id)}
    assert (result.status, result.reward) == ("completed", 1.0), (result.reason, result.recoveries)
    assert result.recoveries == [], result.recoveries
    assert steps[1]["stdout"] == "signalled\n", steps[1]
    assert steps[2]["stdout"] == "python=137\n", steps[2]
    assert steps[3]["stdout"] == "after\n", steps[3]


async def test_an_agent_that_makes_pid1_the_oom_victim_fails_its_own_trajectory(stack):
    """The agent lowers its own OOM score to PID 1's (0; PID 1's is not the agent's to raise)
    and exhausts the memory with processes each smaller than PID 1: PID 1 is killed and the
    sandbox lost -- by the agent, so `failed_policy` with reward 0 and the reason, never
    `failed_infra` (a dropped group) and never a recovery that replays it."""
    attack = BRING_PID1_DOWN
    task = TraceTask(id="pid1-oom", turns=[TraceTurn(think_tokens=4, bash=attack)], check="true")
    handle = await start(stack, task)
    result = await asyncio.wait_for(handle.result(), 600)
    assert (result.status, result.reward) == ("failed_policy", 0.0), result
    assert "OOM" in result.reason and "step 1" in result.reason, result.reason
