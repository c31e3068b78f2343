"""Seeds and orders derived from a run's seed: hashes, never a random generator, so a
workflow's choices replay exactly and a retried or resumed iteration chooses alike."""

from __future__ import annotations

import hashlib


def digest(*parts) -> int:
    """A 64-bit number fixed by `parts` (their `str`s joined by ':')."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")
