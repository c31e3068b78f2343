"""A model's weights as one object: a state dict in a safetensors file.

The trainer writes each version with `store_weights`; a rollout node's publish reads it
back with `load_weights`, which verifies the object's sha256 first. safetensors (and
torch) are imported at the call, so importing the storage package stays light.
"""

from __future__ import annotations

from belayer.storage.store import ObjectRef


def store_weights(store, key: str, tensors, *, if_absent: bool = False) -> ObjectRef:
    """Write a state dict as one safetensors object (what `PublishWeightsArgs.weights` points to);
    with `if_absent`, an object already at `key` must hold these very bytes (ObjectConflict)."""
    from safetensors.torch import save  # import cost: torch, ~2.5 s

    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    return store.put_bytes(key, data, if_absent=if_absent)


def load_weights(store, ref: ObjectRef) -> dict:
    """The state dict at `ref`, its sha256 checked against the reference."""
    from safetensors.torch import load  # import cost: torch, ~2.5 s

    return load(store.get_bytes(ref.key, expected_sha256=ref.sha256))
