"""`RolloutNode.roles()` is a typed `NodeStatus`; the roles file the node worker writes from
it keeps the keys and values `belayer status`, `belayer chaos` and the benchmarks read."""

from __future__ import annotations

import json

from belayer.rollout.hang import Deadlines
from belayer.rollout.recovery import RecoveryEvent
from belayer.rollout.status import NodeStatus, OwnerRecovery, RecoverySummary, rounded

KEYS = {
    "node_id", "owner", "leader", "shadow", "shadow_ready", "epoch", "generation", "weight_mode",
    "weights_version", "leader_version", "shadow_version", "weights_versions_held", "publishing",
    "recoveries", "broken", "owner_state", "shadow_state", "degraded", "protected", "hang_deadline",
    "last_owner_recovery",
}  # fmt: skip


def status(**changes) -> NodeStatus:
    fields = dict(
        node_id="n1", owner=10, leader=11, shadow=12, shadow_ready=True, epoch=2, generation=1,
        weight_mode="private", weights_version=3, leader_version=3, shadow_version=3,
        weights_versions_held=(2, 3), publishing=None, recoveries=0, broken=None, owner_state="alive",
        shadow_state="ready", degraded=None, protected=True,
        hang_deadline=rounded(Deadlines(2.123456, 0.0123456, None, 0)), last_owner_recovery=None,
    )  # fmt: skip
    return NodeStatus(**{**fields, **changes})


def test_the_roles_file_keeps_its_keys_and_values():
    state = json.loads(json.dumps(status().to_json()))
    assert set(state) == KEYS, "last_recovery is absent until the first recovery"
    assert state["weights_versions_held"] == [2, 3]
    assert state["hang_deadline"] == {
        "current_s": 2.1235,
        "decode_step_s": 0.0123,
        "prefill_s_per_1k_tokens": None,
        "pending_prefill_tokens": 0,
    }


def test_the_last_recoveries_are_nested_objects_in_the_file_and_read_back():
    event = RecoveryEvent(
        kind="takeover", reason="leader died", fallback_reason=None, failed_pid=11, epoch=3,
        ready_s=0.123456, phases={"fence_s": 0.011111}, replayed_requests=2, replayed_tokens=40,
        detected_at=1.0, ready_at=1.1, waited_for_shadow_s=0.0,
    )  # fmt: skip
    owner = OwnerRecovery(reason="memory owner exited with -9", protected_again_s=1.5, owner_generation=2)
    full = status(recoveries=1, last_recovery=RecoverySummary.of(event), last_owner_recovery=owner)
    state = json.loads(json.dumps(full.to_json(), sort_keys=True))
    assert set(state) == KEYS | {"last_recovery"}
    assert state["last_recovery"] == {
        "kind": "takeover",
        "reason": "leader died",
        "fallback_reason": None,
        "ready_s": 0.1235,
        "waited_for_shadow_s": 0.0,
        "replayed_requests": 2,
        "replayed_tokens": 40,
        "phases": {"fence_s": 0.0111},
    }
    assert state["last_owner_recovery"] == {
        "reason": "memory owner exited with -9",
        "protected_again_s": 1.5,
        "owner_generation": 2,
    }
    assert NodeStatus.from_json(state) == full
