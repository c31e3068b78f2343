"""Finding a lineage's checkpoints in the object store, for a branch of a finished trajectory.

A running trajectory holds refs to its latest few checkpoints; one that ended (with
`keep_checkpoints`) holds none, but each checkpoint's `meta.json` lies under
`<checkpoint_prefix><sandbox id>/`, so the refs can be rebuilt from a listing. A restore
still checks every ref against the trajectory's log (`SandboxHost.restore`): one taken on
a branch its context later discarded is skipped there, not here.
"""

from __future__ import annotations

from belayer.sandbox.models import CheckpointMeta, CheckpointRef


def checkpoints_at_or_before(store, checkpoint_prefix: str, sandbox_id: str, step: int) -> list[CheckpointRef]:
    """The lineage's checkpoints taken at journal head `step` or before, newest first."""
    prefix = f"{checkpoint_prefix}{sandbox_id}/"
    found = []
    for key in store.list(prefix):
        if not key.endswith("/meta.json"):
            continue
        try:
            meta = CheckpointMeta.model_validate_json(store.get_bytes(key))
        except ValueError:
            continue  # unreadable metadata: a restore could not use it either
        if meta.step <= step:
            found.append((meta.step, meta.created_at, CheckpointRef(
                meta_key=key, step=meta.step, archive_sha256=meta.archive_sha256, archive_bytes=meta.archive_bytes)))
    return [ref for *_, ref in sorted(found, key=lambda f: (f[0], f[1]), reverse=True)]
