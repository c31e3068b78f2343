"""`belayer bench storage` end to end on the test SeaweedFS (small size; figures not judged)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from belayer.cli.bench.storage import storage
from belayer.storage import ObjectStore

from .helpers import RawBucket, storage_env


def test_bench_storage_json_and_cleanup(storage_config, tmp_path):
    cfg = storage_config
    env = storage_env(cfg) | {"BELAYER_STORAGE__PART_SIZE_MB": "5"}
    args = ["--json", "--size-mb", "12", "--repetitions", "2", "--dir", str(tmp_path)]
    result = CliRunner().invoke(storage, args, env=env)
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["size_mb"] == 12 and figures["repetitions"] == 2
    for field in ("upload_mb_s", "download_mb_s", "local_copy_mb_s", "upload_vs_local", "download_vs_local"):
        assert figures[field] > 0
    for path in ("upload", "download", "local_copy"):
        spread = figures[f"{path}_mb_s_spread"]
        assert 0 < spread["min"] <= spread["median"] == figures[f"{path}_mb_s"] <= spread["max"]
    assert list(tmp_path.iterdir()) == []  # temp files gone
    assert RawBucket(cfg).all_keys() == []  # object and its hash record gone
    with ObjectStore(cfg) as store:
        assert list(store.list("")) == []
