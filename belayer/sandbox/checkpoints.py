"""Finding a lineage's checkpoints in the object store, for a branch of a finished trajectory.

A running trajectory holds refs to its latest few checkpoints; one that ended (with
`keep_checkpoints`) holds none, but each checkpoint's `meta.json` lies under
`<checkpoint_prefix><sandbox id>/`, so the refs can be rebuilt from a listing. A restore
still checks every ref against the trajectory's log (`SandboxHost.restore`): one taken on
a branch its context later discarded is skipped there, not here.
"""

from __future__ import annotations

import logging

from belayer.sandbox.host import _ref_of
from belayer.sandbox.models import CheckpointMeta, CheckpointRef
from belayer.storage.errors import CorruptObject

log = logging.getLogger(__name__)


def checkpoints_at_or_before(
    store, checkpoint_prefix: str, sandbox_id: str, step: int
) -> list[CheckpointRef]:
    """The lineage's checkpoints taken at journal head `step` or before, newest first.

    A meta.json that does not parse, or that the store refuses (`CorruptObject`: with a
    storage key, one without a valid MAC -- edited, copied, or planted in the bucket), is
    skipped: a restore could not use it either."""
    prefix = f"{checkpoint_prefix}{sandbox_id}/"
    found = []
    for key in store.list(prefix):
        if not key.endswith("/meta.json"):
            continue
        try:
            meta = CheckpointMeta.model_validate_json(store.get_bytes(key))
        except (ValueError, CorruptObject) as exc:
            log.warning("skipped checkpoint %s of sandbox %s: %s", key, sandbox_id, exc)
            continue
        if meta.step <= step:
            found.append((meta.step, meta.created_at, _ref_of(key, meta)))
    return [ref for *_, ref in sorted(found, key=lambda f: (f[0], f[1]), reverse=True)]
