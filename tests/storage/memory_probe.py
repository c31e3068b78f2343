"""Run as a subprocess: stream an object up and down, print peak memory growth as JSON.

Usage: python -m tests.storage.memory_probe <size_mib>, with the StorageConfig as JSON
on stdin. A separate process, so that the test suite's own memory does not count.

The peak is the kernel's high-water mark of this process's resident set (VmHWM in
/proc/self/status), reset after the baseline through /proc/self/clear_refs. Not
ru_maxrss: that survives fork+exec, so a child of a large pytest process would
report its parent's size.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from belayer.storage import ObjectStore, StorageConfig

MiB = 1 << 20


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class HashingSink:
    """A binary 'file' that keeps only the sha256 and length of what is written."""

    def __init__(self) -> None:
        self.hasher = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.hasher.update(data)
        self.size += len(data)
        return len(data)


def generated(size_mib: int, hasher):
    for _ in range(size_mib):
        chunk = os.urandom(MiB)
        hasher.update(chunk)
        yield chunk


def main() -> None:
    size_mib = int(sys.argv[1])
    cfg = StorageConfig.model_validate_json(sys.stdin.read())
    with ObjectStore(cfg) as store:
        store.put_bytes("memory-probe/warmup", b"x")  # client, connection pool: not counted
        store.get_bytes("memory-probe/warmup")
        baseline = status_bytes("VmRSS")
        peak_was_reset = reset_peak()
        expected = hashlib.sha256()
        ref = store.upload_stream("memory-probe/big", generated(size_mib, expected))
        after_upload = status_bytes("VmHWM")
        sink = HashingSink()
        got = store.download_stream("memory-probe/big", sink)
        peak = status_bytes("VmHWM")
        store.delete_prefix("memory-probe/")
    json.dump(
        {
            "size": ref.size,
            "uploaded_sha256": ref.sha256,
            "generated_sha256": expected.hexdigest(),
            "downloaded_sha256": sink.hasher.hexdigest(),
            "downloaded_size": sink.size,
            "download_ref_ok": got == ref,
            "baseline_rss": baseline,
            "peak_was_reset": peak_was_reset,
            "upload_growth": after_upload - baseline,
            "peak_growth": peak - baseline,
            "part_size": cfg.part_size_mb * MiB,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
