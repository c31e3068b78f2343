"""The leak census on the real object store: a finished sandbox's checkpoint objects are
leaks, its lineage records are kept on purpose (a host that comes back must still learn
that its container is stale)."""

from __future__ import annotations

import pytest

from belayer.chaos.leaks import leftover_objects
from belayer.config import load_config
from belayer.sandbox.lineage import record_key
from belayer.storage.store import ObjectStore

pytestmark = pytest.mark.stack


def test_checkpoint_objects_are_leaks_and_lineage_records_are_not(storage_config, tmp_path):
    config = load_config(state_dir=tmp_path).model_copy(update={"storage": storage_config})
    prefix = config.sandbox.checkpoint_prefix
    with ObjectStore(config.storage) as store:
        store.put_bytes(record_key(prefix, "sbx-ended", 0), b"{}")
        store.put_bytes(record_key(prefix, "sbx-ended", 1), b"{}")
        assert leftover_objects(config, {"sbx-ended"}) == []
        store.put_bytes(f"{prefix}sbx-ended/g1-step3.meta.json", b"{}")
        assert leftover_objects(config, {"sbx-ended"}) == [f"{prefix}sbx-ended/g1-step3.meta.json"]
