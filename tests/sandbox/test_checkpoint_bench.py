"""`belayer bench checkpoint` on a small sandbox: both modes restore a consistent sandbox,
every phase is reported, nothing is left behind. Speed is not asserted."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tests.storage.helpers import RawBucket, storage_env

WORKLOAD = """
tasks:
  - id: small
    setup: [mkdir -p /workspace/p]
    turns:
      - think_tokens: 4
        bash: cd /workspace/p && head -c 3000000 /dev/urandom > data.bin && echo written
      - think_tokens: 4
        bash: nohup python3 -c "import time; state = bytearray(8 << 20); time.sleep(3600)" >/dev/null 2>&1 & echo up
"""


def test_bench_checkpoint_json(sandbox_runtime, storage_config, tmp_path):
    from belayer.cli.bench.checkpoint import checkpoint

    (tmp_path / "small.yaml").write_text(WORKLOAD)
    cfg = storage_config
    result = CliRunner().invoke(
        checkpoint,
        ["--json", "--repetitions", "2", "--workload", str(tmp_path / "small.yaml")],
        env=storage_env(cfg),
        obj={},
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["repetitions"] == 2 and len(report["samples"]) == 4
    for mode in ("belayer", "podman"):
        row = report["modes"][mode]
        assert row["consistent"] is True, mode
        for what in ("checkpoint_s", "restore_s"):
            assert 0 < row[what]["min"] <= row[what]["median"] <= row[what]["max"]
        assert {"freeze", "frozen", "dump", "archive"} <= set(row["checkpoint_phases_s"])
        assert set(row["restore_phases_s"]) == {"fetch", "podman", "ready"}
    assert {"upload_tail", "metadata"} <= set(report["modes"]["belayer"]["checkpoint_phases_s"])
    assert report["checkpoint_speedup"] > 0 and report["restore_speedup"] > 0
    # Every checkpoint of both modes deleted; the lineage records stay by design
    # (belayer/sandbox/lineage.py: a host that comes back must still learn it is stale).
    assert [key for key in RawBucket(cfg).all_keys() if "/lineage/" not in key] == []
