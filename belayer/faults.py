"""Every fault point of Belayer, declared here by name with what it does (`POINTS`), and
the one way to switch them on (`switched_on`, `is_on`).

A fault point is a place that fails on purpose when a test, a chaos run or a benchmark
asks it to: a real crash, hang or damage in the process that reaches it, never a flag
that pretends. Two environment variables switch them on, each a comma-separated list of
`name[:key=value[;key=value]]` naming points of its own: `BELAYER_FAULT` (`ENV`) the
rollout node's and the sandbox host's, `BELAYER_TRAINER_FAULT` (`TRAINER_ENV`) the
trainer's; e.g. `BELAYER_FAULT=engine_crash_during_decode:after=40` or
`BELAYER_FAULT=owner_crash,device_check_fail`. A name that no point of that variable
declares is refused, so a mistyped fault fails loudly instead of testing nothing.

The variable is read when asked: a process reads it once where it starts (an engine, a
memory owner, the trainer's worker), a sandbox host at each fault point, so that a test
can switch one on for one test.

Rollout faults on engines fire in the node's first leader only (lease epoch `epoch`,
default 1), so the engine that takes over does not fault again. A trainer fault fires
once per run (belayer/activities/train.py says how).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

ENV = "BELAYER_FAULT"
TRAINER_ENV = "BELAYER_TRAINER_FAULT"
# What a variable's points belong to, for its messages.
_SWITCHES = {ENV: "rollout or sandbox", TRAINER_ENV: "trainer"}


@dataclass(frozen=True)
class FaultPoint:
    """One place that fails on purpose: which variable switches it on, where it is and
    what happens there (its parameters named as `key`)."""

    name: str
    env: str
    where: str
    what: str


POINTS: dict[str, FaultPoint] = {
    point.name: point
    for point in (
        FaultPoint("engine_crash_before_decode", ENV, "rollout: leader engine",
                   "SIGKILLs itself when the first request arrives"),
        FaultPoint("engine_crash_during_decode", ENV, "rollout: leader engine",
                   "SIGKILLs itself after `after` tokens were streamed"),
        FaultPoint("engine_hang", ENV, "rollout: leader engine",
                   "stops its loop (no heartbeats) after `after` tokens"),
        FaultPoint("owner_crash", ENV, "rollout: memory owner", "SIGKILLs itself `after_s` seconds after it is ready"),
        FaultPoint("device_check_fail", ENV, "rollout: shadow engine", "the device health check reports a wrong result"),
        FaultPoint("publish_switch_fail", ENV, "rollout: shadow engine",
                   "refuses every weights switch (a shadow left behind)"),
        FaultPoint("shadow_start_fail", ENV, "rollout: shadow engine",
                   "SIGKILLs itself while starting, every time (a shadow that cannot start)"),
        FaultPoint("sandbox_restore_damaged_archive", ENV, "sandbox host: restore",
                   "the downloaded archive is cut in half *after* its sha256 check and decompression, "
                   "so podman/CRIU itself fails to restore"),
        FaultPoint("sandbox_kill_during_exec", ENV, "sandbox host: exec",
                   "the container is SIGKILLed right after the action is submitted"),
        FaultPoint("crash_before_checkpoint", TRAINER_ENV, "trainer: train step",
                   "SIGKILL after the optimizer step, before the checkpoint is written (at iteration "
                   "`iteration`, markers in `dir`)"),
        FaultPoint("crash_after_checkpoint", TRAINER_ENV, "trainer: train step",
                   "SIGKILL after the checkpoint is written, before the step returns (at iteration "
                   "`iteration`, markers in `dir`)"),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Fault:
    """A fault point switched on, with its parameters."""

    name: str
    params: dict[str, str] = field(default_factory=dict)

    def number(self, key: str, default: float) -> float:
        return float(self.params.get(key, default))


def parse(spec: str | None, env: str = ENV) -> dict[str, Fault]:
    """The faults `spec` (a value of `env`) switches on, by name."""
    faults: dict[str, Fault] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, rest = item.partition(":")
        point = POINTS.get(name)
        if point is None or point.env != env:
            known = sorted(p.name for p in POINTS.values() if p.env == env)
            raise ValueError(f"unknown {_SWITCHES[env]} fault point {name!r} in {env}; known: {known}")
        faults[name] = Fault(name, dict(kv.split("=", 1) for kv in rest.split(";") if kv))
    return faults


def switched_on(env: str = ENV) -> dict[str, Fault]:
    """The faults the environment variable `env` switches on for this process, now."""
    return parse(os.environ.get(env), env)


def is_on(name: str) -> bool:
    """Whether the fault point `name` (a declared one) is switched on, now."""
    return name in switched_on(POINTS[name].env)


def die_now() -> None:
    """A real crash: SIGKILL, no cleanup, no goodbye message."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # SIGKILL is delivered before this returns


def hang_forever() -> None:
    while True:
        time.sleep(3600)
