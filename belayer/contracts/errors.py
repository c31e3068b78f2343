"""The error types workflows react to: the `type` of the ApplicationError an activity
fails with, and what a sandbox's host found about a lost sandbox.

Activities raise with these names and workflows match them (retry policies' non-retryable
types, the branches that recover, fall back or give up), so both sides name them once,
here. A sandbox error's type is its class's name (the activity runtime's translator, activities/runtime.py).
"""

from __future__ import annotations

from belayer.rollout.errors import NodeFull
from belayer.sandbox.errors import (
    CAUSED_BY_AGENT,
    LOST_UNEXPLAINED,
    HostDraining,
    HostFull,
    PodmanFailed,
    SandboxNotFound,
    SandboxUnreachable,
    StaleGeneration,
)

__all__ = [
    "ACTIVITY_NOT_REGISTERED",
    "BAD_REQUEST",
    "BAD_TRAIN_REQUEST",
    "CAUSED_BY_AGENT",
    "CORRUPT_PREFIX",
    "CORRUPT_SAMPLE",
    "CORRUPT_WEIGHTS",
    "HOST_REFUSED",
    "LOST_UNEXPLAINED",
    "MODEL_NOT_BUILT",
    "NODE_FULL",
    "PODMAN_FAILED",
    "SANDBOX_LOST",
    "STALE_WEIGHTS_VERSION",
    "UNREADABLE_PAYLOAD",
    "WRONG_WEIGHTS_VERSION",
]

# Sandbox activities. A lost sandbox is recovered (`sandbox.recover`); a placed host that
# refuses a new sandbox is avoided and placement asked again.
SANDBOX_LOST = frozenset({SandboxNotFound.__name__, SandboxUnreachable.__name__, StaleGeneration.__name__})
HOST_REFUSED = frozenset({HostFull.__name__, HostDraining.__name__})
PODMAN_FAILED = PodmanFailed.__name__

# `generate`: the turn's request or its context reference is bad; another node would refuse it too.
BAD_REQUEST = "BadRequest"
CORRUPT_PREFIX = "CorruptPrefix"
# `generate`: the node serves its declared capacity; another node, or a later attempt, may not.
NODE_FULL = NodeFull.__name__

# `trainer.train_step`: a sample that does not verify, arguments the trainer cannot serve.
CORRUPT_SAMPLE = "CorruptSample"
BAD_TRAIN_REQUEST = "BadTrainRequest"

# `rollout.publish_weights`.
STALE_WEIGHTS_VERSION = "StaleWeightsVersion"
CORRUPT_WEIGHTS = "CorruptWeights"
MODEL_NOT_BUILT = "ModelNotBuilt"

# `RolloutWorkflow`: the batch asks for a weights version its nodes do not serve (a workflow
# failure the client shows, not an activity's).
WRONG_WEIGHTS_VERSION = "WrongWeightsVersion"

# Any activity: its arguments do not validate against the worker's contract (another
# contract version wrote them); never retried, the message names both versions.
UNREADABLE_PAYLOAD = "UnreadablePayload"
# Temporal's own: the worker that took the task does not register the activity (an older worker).
ACTIVITY_NOT_REGISTERED = "NotFoundError"
