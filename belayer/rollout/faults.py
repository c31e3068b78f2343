"""Named fault points of the rollout node, selected by `BELAYER_FAULT`.

`BELAYER_FAULT` is a comma-separated list of `name[:key=value[;key=value]]`, e.g.
`engine_crash_during_decode:after=40` or `owner_crash,device_check_fail`. Engine faults
fire in the first leader only (lease epoch `epoch`, default 1), so the engine that takes
over does not fault again. The value is read once per process, here and nowhere else.

| name | where | what happens |
|---|---|---|
| engine_crash_before_decode | leader engine | SIGKILL itself when the first request arrives |
| engine_crash_during_decode | leader engine | SIGKILL itself after `after` tokens were streamed |
| engine_hang | leader engine | stops its loop (no heartbeats) after `after` tokens |
| owner_crash | memory owner | SIGKILL itself `after_s` seconds after it is ready |
| device_check_fail | any engine | the device health check reports a wrong result |
| publish_switch_fail | shadow engine | refuses every weights switch (a shadow left behind) |
| shadow_start_fail | shadow engine | SIGKILLs itself while starting, every time (a shadow that cannot start) |
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

ENV = "BELAYER_FAULT"
KNOWN = {
    "engine_crash_before_decode",
    "engine_crash_during_decode",
    "engine_hang",
    "owner_crash",
    "device_check_fail",
    "publish_switch_fail",
    "shadow_start_fail",
}


@dataclass(frozen=True)
class Fault:
    name: str
    params: dict[str, str] = field(default_factory=dict)

    def number(self, key: str, default: float) -> float:
        return float(self.params.get(key, default))


def parse(spec: str | None) -> dict[str, Fault]:
    faults: dict[str, Fault] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, rest = item.partition(":")
        if name not in KNOWN:
            raise ValueError(f"unknown fault point {name!r} in {ENV}; known: {sorted(KNOWN)}")
        params = dict(kv.split("=", 1) for kv in rest.split(";") if kv)
        faults[name] = Fault(name, params)
    return faults


def active(spec: str | None = None) -> dict[str, Fault]:
    """Faults selected for this process (from the environment unless `spec` is given)."""
    return parse(os.environ.get(ENV) if spec is None else spec)


def die_now() -> None:
    """A real crash: SIGKILL, no cleanup, no goodbye message."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # SIGKILL is delivered before this returns


def hang_forever() -> None:
    while True:
        time.sleep(3600)
