"""Observations in the object store: written once by the activity that produced them,
read back (hash-checked) by whoever renders or inspects them.

Only an `ObservationRef` crosses Temporal, so a turn's output (up to the sandbox's
output cap) never enters a payload or a workflow history. Keys name the trajectory, the
step, the sandbox generation that ran it and the observation's own hash: a replay in a
restored sandbox (a new generation) never overwrites what the first run observed.
"""

from __future__ import annotations

from typing import Any

from belayer.sandbox.models import Observation, ObservationRef
from belayer.storage.errors import CorruptObject


def observation_key(trajectory: str, step: int, generation: int, sha256: str) -> str:
    # The last component is "observation": archive encryption covers that name.
    return f"trajectories/{trajectory}/observations/{step:08d}-g{generation}-{sha256[:16]}/observation"


def store_observation(
    store: Any, trajectory: str, step: int, generation: int, obs: Observation
) -> ObservationRef:
    key = observation_key(trajectory, step, generation, obs.sha256)
    stored = store.put_bytes(key, obs.model_dump_json().encode())
    return ObservationRef(
        key=key, object_sha256=stored.sha256, sha256=obs.sha256, exit_code=obs.exit_code,
        duration_s=obs.duration_s, timed_out=obs.timed_out, truncated=obs.truncated,
        replayed_from_journal=obs.replayed_from_journal,
    )  # fmt: skip


def load_observation(store: Any, ref: ObservationRef) -> Observation:
    """The observation `ref` names; `CorruptObject` when the object or its content disagrees."""
    obs = Observation.model_validate_json(store.get_bytes(ref.key, expected_sha256=ref.object_sha256))
    if obs.sha256 != ref.sha256:
        raise CorruptObject(f"{ref.key!r} holds observation {obs.sha256}, its reference says {ref.sha256}")
    return obs
