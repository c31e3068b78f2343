"""`rollout.publish_weights` and `rollout.weights_version`: a new weights version into one
rollout node, by pointer (belayer/activities/publish.py says how)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer.contracts.activity import Activity
from belayer.storage.store import ObjectRef


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PublishWeightsArgs(_Model):
    version: int = Field(ge=2, description="The new version; versions only grow (1 is the built model).")
    weights: ObjectRef | None = Field(
        description="A safetensors file of the model's full state dict (`store_weights`); None: a "
        "project-built model (how a training run puts every node on the weights it starts from)."
    )
    model: str | None = Field(
        None,
        description="With weights None: the project-built model to serve (same layout as the node's "
        "own, built on the node's host); None: the model the node was built from.",
    )
    policy: Literal["finish_on_old", "continue_on_new"] | None = Field(
        None, description="In-flight requests during the switch; None uses the node's rollout.publish_policy."
    )


class PublishWeightsResult(_Model):
    node_id: str
    version: int
    previous_version: int
    policy: str
    fetch_s: float = Field(description="Reading the weights from the object store.")
    staged_s: float
    written_s: float
    sealed_s: float
    switched_s: float = Field(description="Seconds from the hand-over until both engines serve the version.")
    paused_requests: int
    drained_requests: int
    already_published: bool = False


PUBLISH_WEIGHTS = Activity("rollout.publish_weights", PublishWeightsArgs, PublishWeightsResult)
# The version the node serves now (1: the model it was built from).
WEIGHTS_VERSION = Activity("rollout.weights_version", None, int)


class PublishedWeights(_Model):
    """What a node serves, recorded after each publish so that a restarted node worker
    comes back on it instead of on the model it was built from: its shared memory died
    with it, and a training run's next rollouts must not sample older weights."""

    version: int
    weights: ObjectRef | None
    model: str | None = None


# The weights the stack's nodes serve, recorded in the stack's object store by every publish:
# a node that starts (a new one, or one whose own memory is older) comes up on them, so one
# stack serves one policy whichever node a turn lands on.
STACK_WEIGHTS_KEY = "rollout/stack-weights.json"
