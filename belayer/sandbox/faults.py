"""Named fault points of the sandbox host, selected by `BELAYER_FAULT` (comma-separated).

| name | where | what happens |
|---|---|---|
| sandbox_restore_damaged_archive | restore | the downloaded archive is cut in half *after* its sha256 check and decompression, so podman/CRIU itself fails to restore |
| sandbox_kill_during_exec | exec | the container is SIGKILLed right after the action is submitted |

Read here and nowhere else; read at each fault point, so a test can set it per test.
"""

from __future__ import annotations

import os

ENV = "BELAYER_FAULT"
KNOWN = {"sandbox_restore_damaged_archive", "sandbox_kill_during_exec"}


def active(name: str) -> bool:
    assert name in KNOWN, name
    names = {part.split(":", 1)[0].strip() for part in os.environ.get(ENV, "").split(",")}
    return name in names
