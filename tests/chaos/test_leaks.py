"""The leak census on the real object store: a finished sandbox's checkpoint objects and
its captures never published are leaks, its lineage records are kept on purpose (a host
that comes back must still learn that its container is stale)."""

from __future__ import annotations

from belayer.chaos.leaks import leftover_objects
from belayer.config import load_config
from belayer.sandbox.lineage import record_key
from belayer.storage.store import open_store


def test_checkpoint_objects_are_leaks_and_lineage_records_are_not(storage_config, tmp_path):
    config = load_config(state_dir=tmp_path).model_copy(update={"storage": storage_config})
    prefix = config.sandbox.checkpoint_prefix
    with open_store(config.storage, encrypted=False) as store:
        store.put_bytes(record_key(prefix, "sbx-ended", 0), b"{}")
        store.put_bytes(record_key(prefix, "sbx-ended", 1), b"{}")
        assert leftover_objects(config, {"sbx-ended"}) == []
        store.put_bytes(f"{prefix}sbx-ended/g1-step3.meta.json", b"{}")
        assert leftover_objects(config, {"sbx-ended"}) == [f"{prefix}sbx-ended/g1-step3.meta.json"]


def test_a_capture_never_published_is_a_leak_of_its_sandbox_only(storage_config, tmp_path):
    from belayer.sandbox.staging import STAGED_DIR

    config = load_config(state_dir=tmp_path).model_copy(update={"storage": storage_config})
    staged = tmp_path / STAGED_DIR / "belayer-sandbox-somehost"
    staged.mkdir(parents=True)
    (staged / "sbx-ended--00000003-g1-ab12cd34.tar").write_bytes(b"tar")
    (staged / "sbx-running--00000005-g0-ef56ab78.tar").write_bytes(b"tar")
    assert leftover_objects(config, {"sbx-ended"}) == [
        f"unpublished capture {staged / 'sbx-ended--00000003-g1-ab12cd34.tar'}"
    ]
