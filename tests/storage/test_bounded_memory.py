"""A 256 MiB object streams up and down without needing 256 MiB of memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def test_256_mib_stream_has_bounded_peak_rss(storage_config, record_property):
    size_mib = 256
    proc = subprocess.run(
        [sys.executable, "-m", "tests.storage.memory_probe", str(size_mib)],
        input=_config_json(storage_config),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    record_property("peak_rss_growth_mib", round(result["peak_growth"] / MiB, 1))
    print(
        f"\npeak RSS growth {result['peak_growth'] / MiB:.1f} MiB (upload {result['upload_growth'] / MiB:.1f} MiB), "
        f"part size {result['part_size'] // MiB} MiB"
    )
    assert result["size"] == result["downloaded_size"] == size_mib * MiB
    assert result["uploaded_sha256"] == result["generated_sha256"] == result["downloaded_sha256"]
    assert result["download_ref_ok"]
    # Two parts in flight is 32 MiB at the default part size; 128 MiB leaves room for
    # the allocator and botocore's buffers but not for holding the object.
    assert result["peak_growth"] < 128 * MiB


def _config_json(cfg) -> str:
    """The config with its secrets revealed, for the probe process (every SecretStr field)."""
    from pydantic import SecretStr

    data = cfg.model_dump()
    for name, value in data.items():
        if isinstance(value, SecretStr):
            data[name] = value.get_secret_value()
    return json.dumps(data)
