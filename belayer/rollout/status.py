"""What a rollout node says about itself: `NodeStatus`, the value of `RolloutNode.roles()`.

Typed and frozen, so a reader in the node's process (the publish activity, benchmarks,
tests) reads attributes that a type checker knows, and a snapshot never changes under its
reader. Where it leaves the process (the node worker's roles file, read by `belayer status`,
`belayer chaos` and the benchmarks) `to_json()` gives the same keys and values the node has
always written, so a reader of an older node's file and this one agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from belayer.rollout.hang import Deadlines
from belayer.rollout.recovery import RecoveryEvent

# Seconds in the status are rounded to this many digits: enough to compare phases, short
# to read in the roles file.
DIGITS = 4


@dataclass(frozen=True)
class RecoverySummary:
    """The last takeover or cold start, as `belayer status` shows it (the full record is
    `RolloutNode.recoveries`)."""

    kind: str
    reason: str
    fallback_reason: str | None
    ready_s: float
    waited_for_shadow_s: float
    replayed_requests: int
    replayed_tokens: int
    phases: dict[str, float]

    @classmethod
    def of(cls, event: RecoveryEvent) -> RecoverySummary:
        return cls(
            kind=event.kind,
            reason=event.reason,
            fallback_reason=event.fallback_reason,
            ready_s=round(event.ready_s, DIGITS),
            waited_for_shadow_s=round(event.waited_for_shadow_s, DIGITS),
            replayed_requests=event.replayed_requests,
            replayed_tokens=event.replayed_tokens,
            phases={k: round(v, DIGITS) for k, v in event.phases.items()},
        )


@dataclass(frozen=True)
class Load:
    """The node's declared capacity (belayer/rollout/admission.py), what it serves of it
    now, and how many requests it refused for want of it since it started."""

    sequences: int
    kv_tokens: int
    in_flight: int
    refused: int


@dataclass(frozen=True)
class OwnerRecovery:
    """How long the node was unprotected after its memory owner died."""

    reason: str
    protected_again_s: float
    owner_generation: int


@dataclass(frozen=True)
class NodeStatus:
    """Pids by role, lease epoch, weights versions, recoveries so far and the last one."""

    node_id: str
    owner: int | None  # pids
    leader: int | None
    shadow: int | None
    shadow_ready: bool
    epoch: int
    generation: int
    weight_mode: str
    weights_version: int  # what the engines compute with once any publish settles
    leader_version: int | None
    shadow_version: int | None  # None until the shadow is ready
    weights_versions_held: tuple[int, ...]  # by the memory owner, ascending
    publishing: int | None  # the version being published
    recoveries: int
    broken: str | None
    owner_state: str  # none | degraded | waiting | re-adopting | restoring | missing ... | alive
    shadow_state: str  # off | degraded | waiting | starting | ready
    degraded: str | None
    protected: bool  # a leader failure now would be a takeover
    hang_deadline: Deadlines
    last_owner_recovery: OwnerRecovery | None
    last_recovery: RecoverySummary | None = None
    capacity: Load | None = None  # None in a roles file from before nodes declared it

    def to_json(self) -> dict[str, Any]:
        """The keys and values the node worker writes to its roles file; `last_recovery` is
        absent until the first recovery."""
        state = asdict(self)
        state["weights_versions_held"] = list(self.weights_versions_held)
        if self.last_recovery is None:
            del state["last_recovery"]
        if self.capacity is None:
            del state["capacity"]
        return state

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> NodeStatus:
        """The inverse of `to_json` (a roles file read back)."""
        owner, last, capacity = (
            state.get("last_owner_recovery"),
            state.get("last_recovery"),
            state.get("capacity"),
        )
        return cls(
            **{
                **state,
                "weights_versions_held": tuple(state["weights_versions_held"]),
                "hang_deadline": Deadlines(**state["hang_deadline"]),
                "last_owner_recovery": OwnerRecovery(**owner) if owner else None,
                "last_recovery": RecoverySummary(**last) if last else None,
                "capacity": Load(**capacity) if capacity else None,
            }
        )


def rounded(deadlines: Deadlines) -> Deadlines:
    """The hang deadline and its inputs as the status shows them."""
    return Deadlines(**{k: None if v is None else round(v, DIGITS) for k, v in asdict(deadlines).items()})
