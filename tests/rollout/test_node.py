"""The rollout node on the real engine (vLLM CPU, tiny model, fp32), in both weight modes.

Every scenario runs the same requests uninterrupted first and then under a real fault
(SIGKILL, SIGSTOP, a killed owner, corrupted weights) and compares the tokens: a recovery
must be invisible in the output. Faults are triggered by token progress, never by time.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import threading
import time

import pytest

from belayer.rollout import recovery, shm
from belayer.rollout.admission import Capacity
from belayer.rollout.errors import BadRequestError, NodeFull
from belayer.rollout.protocol import SamplingSpec
from belayer.rollout.status import NodeStatus
from belayer.workers.rollout.worker import describe_roles
from tests.rollout.conftest import PROMPTS, SPECS, flip_a_weight_byte, owner_recovery_after

_baselines: dict[str, list] = {}


def baseline(node) -> list[list[int]]:
    """Tokens of an uninterrupted run on this node (computed once per node)."""
    key = node.config.node_id
    if key not in _baselines:
        handles = [node.submit(p, s) for p, s in zip(PROMPTS, SPECS, strict=True)]
        _baselines[key] = [h.result(300) for h in handles]
        assert all(len(c.token_ids) == s.max_tokens for c, s in zip(_baselines[key], SPECS, strict=True))
    return [c.token_ids for c in _baselines[key]]


def assert_logprobs_as_unfailed(node, results) -> None:
    """The determinism contract: the same prefix, seed and version give the same logprobs
    (to 1e-4: a replay prefills what the unfailed run decoded, and fp32 sums differ in order)."""
    baseline(node)
    unfailed = _baselines[node.config.node_id]
    for got, want in zip(results, unfailed, strict=True):
        assert len(got.logprobs) == len(want.logprobs) == len(got.token_ids)
        worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
        assert worst <= 1e-4, f"request {got.request_id}: logprobs differ by up to {worst}"


def signal_leader_at(node, tokens: int, sig: int):
    """on_progress callback: send `sig` to the leader once the request has `tokens` tokens.
    It runs on the node's pump thread, so the fault lands at an exact point of progress."""
    fired = {}

    def on_progress(n: int) -> None:
        if not fired and n >= tokens:
            fired["pid"] = node.holders.leader.pid
            os.kill(fired["pid"], sig)

    on_progress.fired = fired
    return on_progress


def run_with_fault(node, trigger) -> list:
    handles = [
        node.submit(p, s, on_progress=trigger if i == 0 else None)
        for i, (p, s) in enumerate(zip(PROMPTS, SPECS, strict=True))
    ]
    return [h.result(300) for h in handles]


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_kill_primary_mid_decode_replays_token_identically(node):
    expected = baseline(node)
    before = len(node.recoveries)
    shadow_pid = node.holders.shadow.pid
    published: list[dict] = []

    def publish(status: NodeStatus) -> None:
        published.append(status.to_json())  # what the node worker writes for `belayer chaos`

    node.add_state_listener(publish)
    trigger = signal_leader_at(node, 60, signal.SIGKILL)
    try:
        results = run_with_fault(node, trigger)
    finally:
        node.remove_state_listener(publish)
    assert trigger.fired, "the leader was never killed"
    assert [r.token_ids for r in results] == expected
    assert_logprobs_as_unfailed(node, results)
    event = node.recoveries[before]
    assert event.kind == "takeover" and event.fallback_reason is None
    assert event.replayed_requests == len(PROMPTS), "every request must have been in flight"
    assert all(r.recoveries[:1] == ("takeover",) for r in results)
    assert event.failed_pid == trigger.fired["pid"]
    after = next(p for p in published if p["recoveries"] == before + 1)
    assert after["leader"] == shadow_pid and after["epoch"] == event.epoch
    assert after["last_recovery"]["kind"] == "takeover" and after["leader"] != trigger.fired["pid"]


def test_hung_primary_is_detected_and_replaced(node):
    expected = baseline(node)
    before = len(node.recoveries)
    trigger = signal_leader_at(node, 40, signal.SIGSTOP)  # alive but silent: only heartbeats tell
    results = run_with_fault(node, trigger)
    assert [r.token_ids for r in results] == expected
    event = node.recoveries[before]
    assert event.kind == "takeover" and "missed heartbeats" in event.reason
    # caught within the deadline derived from the tiny model's steps (the floor), not the
    # configured upper bound: silence is measured from the leader's last message
    silent_s = float(re.search(r"silent for ([0-9.]+) s", event.reason).group(1))
    assert silent_s < node.config.heartbeat_timeout_s, event.reason
    assert node.roles().hang_deadline.decode_step_s is not None


def test_shadow_never_holds_a_writable_arena_while_primary_has_the_lease(node):
    baseline(node)
    arena = node.holders.owner.ready.arena_path
    assert _arena_perms(node.holders.leader.pid, arena) == "rw-s"
    assert _arena_perms(node.holders.shadow.pid, arena) == "r--s"  # a stray write would fault
    with open(arena, "rb") as f:  # the kernel lock is held by the leader
        with pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert shm.read_arena_header(arena).epoch == node.holders.epoch


def test_bad_input_is_rejected_and_the_node_keeps_serving(node):
    vocab = node.vocab_size
    with pytest.raises(BadRequestError, match="outside the model's vocabulary") as err:
        node.submit([1, 2, vocab], SamplingSpec(max_tokens=4))
    assert err.value.retryable is False
    with pytest.raises(BadRequestError, match="does not fit the context"):
        node.submit([3] * node.config.max_model_len, SamplingSpec(max_tokens=4))
    with pytest.raises(BadRequestError):
        node.submit([], SamplingSpec(max_tokens=4))
    done = node.generate(PROMPTS[0], SPECS[0], timeout=300)
    assert done.token_ids == baseline(node)[0]


def test_owner_killed_is_replaced_and_a_takeover_needs_no_cold_start(node):
    """The replacement owner adopts the segments that still verify; the shadow, loaded from
    the dead owner, proves its own weights (sketch) before it leads."""
    expected = baseline(node)
    generation = node.holders.generation
    os.kill(node.holders.owner.pid, signal.SIGKILL)
    wait_for(
        lambda: node.holders.generation > generation and node.owner_role.failure is None,
        "the replacement owner",
    )
    wait_for(lambda: owner_recovery_after(node, generation), "the node to be protected again")
    roles = node.roles()
    assert roles.owner_state == "alive" and roles.shadow_state == "ready" and roles.protected
    assert roles.last_owner_recovery.owner_generation == node.holders.generation
    assert 0 < roles.last_owner_recovery.protected_again_s < 60
    assert "exited with -9" in roles.last_owner_recovery.reason
    before = len(node.recoveries)
    results = run_with_fault(node, signal_leader_at(node, 60, signal.SIGKILL))
    assert [r.token_ids for r in results] == expected
    event = node.recoveries[before]
    assert event.kind == "takeover" and event.fallback_reason is None
    assert "shadow_sketch_s" in event.phases, "the shadow's own weights were not verified"


def test_owner_killed_with_a_corrupted_segment_is_rebuilt_and_nothing_wrong_is_served(node):
    """Its successor rejects the segment (checksums) and rebuilds version 1 from the model
    files; shared engines, which may read the bad bytes in place, are replaced at once."""
    expected = baseline(node)
    owner, generation, before = node.holders.owner, node.holders.generation, len(node.recoveries)
    os.kill(owner.pid, signal.SIGSTOP)  # frozen while its segment is damaged
    flip_a_weight_byte(owner.ready.weights_path)
    os.kill(owner.pid, signal.SIGKILL)
    wait_for(
        lambda: node.holders.generation > generation and node.owner_role.failure is None,
        "the replacement owner",
    )
    shared = node.config.weight_mode == "shared"
    if shared:
        wait_for(lambda: len(node.recoveries) > before, "the recovery of the engines that read the bad bytes")
        event = node.recoveries[before]  # a shadow leads only if its own weights prove sound
        assert "failed verification" in event.reason, event
        assert event.kind == "cold_start" or "shadow_sketch_s" in event.phases, event
    wait_for(lambda: node.roles().protected, "the node to be protected again")
    results = run_with_fault(node, None)
    assert [r.token_ids for r in results] == expected
    assert_logprobs_as_unfailed(node, results)
    assert len(node.recoveries) == before + (1 if shared else 0)


def test_an_arena_unlinked_under_the_node_is_rebuilt_and_the_node_serves_on(node):
    """Someone removed the KV arena from /dev/shm (a stray cleanup; the engines still map
    the unlinked pages): the next takeover cannot check the arena, falls back to a cold
    start whose new owner builds a new arena, and the node serves the same tokens."""
    expected = baseline(node)
    arena = node.holders.owner.ready.arena_path
    arena.unlink()
    before = len(node.recoveries)
    results = run_with_fault(node, signal_leader_at(node, 40, signal.SIGKILL))
    assert [r.token_ids for r in results] == expected
    event = node.recoveries[before]
    assert event.kind == "cold_start" and "arena" in (event.fallback_reason or ""), event
    roles = node.roles()
    assert roles.broken is None
    assert node.holders.owner.ready.arena_path.exists() and node.holders.owner.ready.arena_path != arena
    wait_for(lambda: node.roles().protected, "the node to be protected again")


def test_corrupted_weights_mean_cold_start_never_a_wrong_answer(node):
    if node.config.weight_mode != "shared":
        pytest.skip("run where engines read the owner's bytes directly (shared), the harder case")
    expected = baseline(node)
    flip_a_weight_byte(node.holders.owner.ready.weights_path)
    before = len(node.recoveries)
    verdict = node.verify_weights()
    assert not verdict.ok and verdict.bad_tensors
    wait_for(lambda: len(node.recoveries) > before, "the cold start after the checksum mismatch")
    assert node.recoveries[before].kind == "cold_start"
    assert "checksum" in node.recoveries[before].reason
    results = run_with_fault(node, signal_leader_at(node, 60, signal.SIGKILL))  # and a takeover on top
    assert [r.token_ids for r in results] == expected
    assert_logprobs_as_unfailed(node, results)


def _arena_perms(pid: int, arena) -> str:
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(arena)):
                return line.split()[1]
    raise AssertionError(f"process {pid} does not map {arena}")


def test_submits_and_status_go_on_during_a_cold_start(node, monkeypatch):
    """The loop runs a cold start without the node lock: a caller is answered meanwhile.
    The cold start is held at a gate until the caller has its answers, so the order is
    fixed; a node lock held through recovery would leave the gate to time out."""
    if node.config.weight_mode != "private":
        pytest.skip("the locking does not depend on the weight mode; run once, in private mode")
    expected = baseline(node)
    gate, timed_out = threading.Event(), []
    original = recovery._cold_start

    def gated(*args, **kwargs):
        timed_out.append(not gate.wait(120))
        return original(*args, **kwargs)

    monkeypatch.setattr(recovery, "_cold_start", gated)
    before = len(node.recoveries)
    node.force_full_cold_start_next("test: status and submits during a cold start")
    os.kill(node.holders.leader.pid, signal.SIGKILL)
    wait_for(lambda: node.roles().leader is None, "the recovery to begin")
    state = node.roles()
    handle = node.submit(PROMPTS[0], SPECS[0])
    gate.set()
    assert handle.result(300).token_ids == expected[0]
    assert timed_out == [False], "status and submit waited for the cold start"
    assert state.leader is None and node.recoveries[before].kind == "cold_start"


def test_a_node_at_its_capacity_refuses_at_once_and_admits_again_when_a_request_ends(node, monkeypatch):
    """A node declares its capacity (sequences, KV tokens) and never queues past it inside
    the engine: one request more is refused at once (`NodeFull`, retryable elsewhere), the
    status counts it, and room comes back with the first request that ends."""
    if node.config.weight_mode != "private":
        pytest.skip("admission does not depend on the weight mode; run once, in private mode")
    declared = node.roles().capacity
    assert (declared.sequences, declared.kv_tokens) == (
        node.config.max_num_seqs,
        8192,
    )  # 64 MiB, 8 KiB a token
    monkeypatch.setattr(node, "capacity", Capacity(sequences=2, kv_tokens=declared.kv_tokens))
    refused_before = node.refused
    long = SamplingSpec(max_tokens=400, ignore_eos=True)
    first, second = node.submit(PROMPTS[0], long), node.submit(PROMPTS[1], SPECS[4])
    assert not node.has_room()
    with pytest.raises(
        NodeFull, match=r"2 sequences in flight, its capacity \(rollout.max_num_seqs = 2\)"
    ) as full:
        node.submit(PROMPTS[2], SPECS[0])
    assert full.value.retryable
    state = node.roles()
    assert (state.capacity.in_flight, state.capacity.refused) == (2, refused_before + 1)
    assert NodeStatus.from_json(state.to_json()).capacity == state.capacity  # the roles file keeps it
    assert re.search(r"2/2 sequences \(\d+ KV tokens\), \d+ refused at capacity", describe_roles(state))
    second.result(300)
    wait_for(node.has_room, "room after a request ended")
    assert (
        len(node.submit(PROMPTS[2], SamplingSpec(max_tokens=8, ignore_eos=True)).result(300).token_ids) == 8
    )
    first.result(300)
    monkeypatch.setattr(node, "capacity", Capacity(sequences=8, kv_tokens=50))
    with pytest.raises(
        NodeFull, match=r"0 KV tokens held and 100 asked, over its 50 \(rollout.kv_cache_mb\)"
    ):
        node.submit(list(range(100, 200)), SPECS[0])
