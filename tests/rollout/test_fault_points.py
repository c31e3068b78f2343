"""Named fault points (BELAYER_FAULT) on a real node: the same requests with and without
the fault must give the same tokens."""

from __future__ import annotations

import time

import pytest

from belayer.rollout.restarts import DEGRADED_AFTER
from tests.rollout.conftest import PROMPTS, SPECS, NodeUnderTest, node_config


@pytest.fixture
def faulty_node(request, monkeypatch, tiny_model):
    monkeypatch.setenv("BELAYER_FAULT", request.param)
    nut = NodeUnderTest(node_config(weight_mode="private"), tiny_model)
    try:
        nut.start()
        yield nut.node
    finally:
        left = nut.close()
    assert not left, f"node leaked: {left}"


def run_all(node):
    handles = [node.submit(p, s) for p, s in zip(PROMPTS, SPECS, strict=True)]
    return [h.result(300).token_ids for h in handles]


@pytest.mark.parametrize("faulty_node", ["engine_crash_before_decode"], indirect=True)
def test_crash_before_decode_is_taken_over(faulty_node):
    under_fault = run_all(faulty_node)
    assert faulty_node.recoveries[0].kind == "takeover"
    assert faulty_node.wait_shadow_ready()
    assert run_all(faulty_node) == under_fault  # the new leader, uninterrupted


@pytest.mark.parametrize("faulty_node", ["engine_hang:after=40,device_check_fail"], indirect=True)
def test_hang_with_failed_device_check_falls_back_to_cold_start(faulty_node):
    under_fault = run_all(faulty_node)
    event = faulty_node.recoveries[0]  # a starved engine may add a later one
    assert event.kind == "cold_start"
    assert "heartbeat" in event.reason and "device health check" in event.fallback_reason
    assert event.replayed_requests == len(PROMPTS)
    assert run_all(faulty_node) == under_fault


@pytest.mark.parametrize(
    "faulty_node", ["owner_crash:after_s=0,engine_crash_during_decode:after=60"], indirect=True
)
def test_owner_crash_then_engine_crash_is_a_takeover_not_a_cold_start(faulty_node):
    """The owner's death no longer forces a cold start: a replacement adopts its verified
    segments, and the shadow proves its own weights (sketch) before it leads."""
    under_fault = run_all(faulty_node)
    event = faulty_node.recoveries[0]  # a starved engine may add a later one
    assert event.kind in ("takeover", "takeover_after_wait") and event.fallback_reason is None
    assert "shadow_sketch_s" in event.phases
    assert event.replayed_requests == len(PROMPTS)
    assert faulty_node.holders.generation == 2  # the replacement owner, which adopted the segments
    assert run_all(faulty_node) == under_fault


@pytest.mark.parametrize("faulty_node", ["shadow_start_fail"], indirect=True)
def test_a_shadow_that_never_starts_backs_off_and_the_leader_serves_alone(faulty_node):
    node = faulty_node
    deadline = time.monotonic() + 60
    while node.roles().shadow_state != "degraded":
        assert time.monotonic() < deadline, f"never degraded: {node.roles()}"
        time.sleep(0.1)
    roles = node.roles()
    assert f"failed {DEGRADED_AFTER} times in a row" in roles.degraded and not roles.protected
    failures = node.shadow_role.restarts.failures
    time.sleep(3)  # the next start is 4 s away, then 8 s: no crash loop
    assert node.shadow_role.restarts.failures <= failures + 1
    results = run_all(node)
    assert [len(t) for t in results] == [s.max_tokens for s in SPECS]  # the leader alone serves
    assert not node.recoveries and node.shadow_role.restarts.degraded
