"""Host side of the channel to the in-sandbox supervisor (infra/sandbox/supervisor.py).

One JSON request per connection over the unix socket the supervisor listens on in the
sandbox's bind-mounted channel directory; every connection is closed before the call
returns, so a checkpoint taken between calls never holds a connection (docs/design.md §7).
Stdlib only; no policy here (exactly-once and generations are the supervisor's).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from belayer.sandbox.errors import (
    SandboxBusy,
    SandboxError,
    SandboxUnreachable,
    StaleGeneration,
    SupervisorRefused,
)

SOCKET_NAME = "supervisor.sock"

_KINDS = {"StaleGeneration": StaleGeneration, "Busy": SandboxBusy}


def call(sock_path: str | Path, request: dict, timeout_s: float = 30.0) -> dict:
    """Send one request, return the reply's fields; supervisor refusals raise typed errors."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout_s)
        try:
            s.connect(str(sock_path))
            s.sendall(json.dumps(request, separators=(",", ":")).encode() + b"\n")
            chunks = []
            while True:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        except (TimeoutError, OSError) as exc:
            raise SandboxUnreachable(
                f"no answer from the sandbox supervisor at {sock_path} ({type(exc).__name__}: {exc}); "
                "the sandbox is dead or not started: recover it from its latest checkpoint"
            ) from exc
    finally:
        s.close()
    data = b"".join(chunks)
    if not data:
        raise SandboxUnreachable(f"the sandbox supervisor at {sock_path} closed without answering")
    reply = json.loads(data)
    if not reply.get("ok"):
        err = reply.get("error") or {}
        kind = err.get("type", "")
        cls = _KINDS.get(kind, SupervisorRefused)
        exc = cls(f"sandbox supervisor refused: {err.get('message', reply)}")
        exc.kind = kind  # type: ignore[attr-defined]
        raise exc
    return reply


def wait_ready(sock_path: str | Path, timeout_s: float) -> dict:
    """Ping until the supervisor answers (it starts in well under a second)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return call(sock_path, {"op": "ping"}, timeout_s=5.0)
        except SandboxError as exc:
            last = exc
            time.sleep(0.02)
    raise SandboxUnreachable(f"the sandbox supervisor did not start within {timeout_s:g}s: {last}")


def run_action(
    sock_path: str | Path,
    *,
    trajectory: str,
    step: int,
    generation: int,
    command: str,
    timeout_s: float,
    output_cap: int,
    isolated: bool = False,
    processes: str = "frozen",
    poll_s: float = 2.0,
) -> dict:
    """Submit an action and poll until it is done; returns the supervisor's reply.

    `isolated`: run it in a clean process that inherits nothing of the agent's shell (the
    check); `processes` ("frozen" or "running"): whether the agent's processes are stopped
    while it runs.
    """
    req = {
        "op": "submit", "trajectory": trajectory, "step": step, "generation": generation,
        "command": command, "timeout_s": timeout_s, "output_cap": output_cap, "wait_s": poll_s,
        "isolated": isolated, "processes": processes,
    }  # fmt: skip
    reply = call(sock_path, req, timeout_s=poll_s + 30)
    while reply["state"] != "done":
        req["op"] = "wait"
        reply = call(sock_path, req, timeout_s=poll_s + 30)
    return reply
