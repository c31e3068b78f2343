"""The publish protocol when a step of it fails: a late owner reply, a failed write, a
takeover or a damaged segment during a finish-on-old drain, a shadow that could not switch.

One real node (shared mode: the engines read the owner's segments in place, the case where
a damaged segment matters most; tiny model, fp32). Every fault is placed by state, never by
time: the owner or a leader is frozen with SIGSTOP at an exact point and let go (SIGCONT)
or killed (SIGKILL) when the test says so. The node's hang deadline is raised out of the way
so that a frozen leader is a paused process, not a hung one.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from belayer.rollout import children
from belayer.rollout import publish as publish_module
from belayer.rollout.errors import BadRequestError, RolloutError
from belayer.rollout.protocol import SamplingSpec, StageWeights
from belayer.rollout.status import NodeStatus
from tests.rollout.conftest import flip_a_weight_byte, node_config, started_node

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingSpec(max_tokens=120, ignore_eos=True)


def _load(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def contents(tiny_model):
    """Two weight contents that give different tokens: the built weights and a perturbation."""
    import torch

    base = _load(tiny_model)
    gen = torch.Generator().manual_seed(38)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(base.items())}
    return {"base": base, "perturbed": perturbed}


@pytest.fixture(scope="module")
def node_under_test(tiny_model):
    config = node_config(
        weight_mode="shared", heartbeat_timeout_s=600.0, hang_floor_s=600.0, weights_verify_interval_s=0.5
    )
    yield from started_node(config, tiny_model)


@pytest.fixture
def node(node_under_test):
    n = node_under_test.node
    assert n.wait_shadow_ready(), "shadow did not come back"
    node_under_test.remember()
    yield n
    node_under_test.remember()


def next_version(node) -> int:
    return max([node.target_version, *node.owner_role.versions]) + 1


def weights_of(contents, version: int) -> dict:
    """Versions alternate between the two contents, so consecutive ones differ."""
    return contents["perturbed" if version % 2 == 0 else "base"]


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def segments_of(node, version: int) -> list:
    from belayer.rollout import shm

    return [p for p in shm.leftover_segments(node.config.node_id) if p.name.endswith(f"-v{version}")]


class InThread:
    """Run `fn` on a thread; `result()` returns its value or raises its exception."""

    def __init__(self, fn):
        self.box: dict = {}
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.box["value"] = fn()
        except BaseException as exc:
            self.box["error"] = exc

    def result(self, timeout: float = 300.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        if "error" in self.box:
            raise self.box["error"]
        return self.box["value"]


def stop_leader_at(node, tokens: int):
    """on_progress: SIGSTOP the leader once the request has `tokens` tokens (runs on the
    node's loop, so the request is frozen in flight at an exact point)."""
    stopped: dict = {}

    def on_progress(n: int) -> None:
        if not stopped and n >= tokens:
            stopped["pid"] = node.holders.leader.pid
            os.kill(stopped["pid"], signal.SIGSTOP)

    on_progress.stopped = stopped
    return on_progress


def test_a_late_seal_reply_is_not_taken_for_the_retried_publish(node, contents, monkeypatch):
    """A publish times out while the owner seals (frozen); the caller retries the same
    version (as Temporal retries the activity). The owner's late `Sealed` of the first
    attempt must not answer the retry's `StageWeights`, and the first attempt's segment must
    not make the version unusable: the retry publishes it."""
    version = next_version(node)
    owner = node.holders.owner.pid
    original = publish_module.write_staged

    def write_then_freeze_the_owner(path, tensors, dtype):
        expected = original(path, tensors, dtype)
        os.kill(owner, signal.SIGSTOP)  # the seal that follows cannot answer in time
        return expected

    monkeypatch.setattr(publish_module, "write_staged", write_then_freeze_the_owner)
    try:
        with pytest.raises(RolloutError, match="not done after"):
            node.publish(version, weights_of(contents, version), timeout=10)
        monkeypatch.setattr(publish_module, "write_staged", original)
        stage_sent = threading.Event()
        send = children.send

        def noting_stages(child, msg):
            if isinstance(msg, StageWeights) and msg.version == version:
                stage_sent.set()
            send(child, msg)

        monkeypatch.setattr(children, "send", noting_stages)
        retry = InThread(lambda: node.publish(version, weights_of(contents, version)))
        assert stage_sent.wait(60), "the retry never asked the owner to stage"
    finally:
        os.kill(owner, signal.SIGCONT)  # its late Sealed is now behind the retry's request
    report = retry.result()
    assert report.version == version and node.target_version == version
    assert set(node.generate(PROMPT, GREEDY, timeout=300).versions) == {version}
    assert [p.name for p in segments_of(node, version)] == [node.owner_role.versions[version].name]


def test_a_publish_whose_write_failed_leaves_no_segment_and_can_be_published_again(node, contents):
    """A write that fails (here: a state dict missing a tensor) must unstage the segment;
    otherwise the version exists on the owner, unsealed, until the owner is replaced."""
    version = next_version(node)
    incomplete = dict(weights_of(contents, version))
    incomplete.pop(sorted(incomplete)[0])
    with pytest.raises(BadRequestError, match="do not match the served model"):
        node.publish(version, incomplete)
    wait_until(lambda: not segments_of(node, version), f"the staged segment of version {version} to go")
    report = node.publish(version, weights_of(contents, version))
    assert report.version == version
    assert set(node.generate(PROMPT, GREEDY, timeout=300).versions) == {version}


def test_a_shadow_started_during_a_finish_on_old_drain_starts_on_the_pinned_version(node, contents):
    """A takeover during a finish-on-old drain leaves the old requests on the old version;
    the shadow started after it must be on that version too, so that a second takeover still
    finishes them on it (a shadow on the new version would un-pin them)."""
    old = node.target_version
    unfailed = node.generate(PROMPT, GREEDY, timeout=300).token_ids
    version = next_version(node)
    first_leader, frozen = node.holders.leader.pid, {}

    def freeze_the_new_leader(state: NodeStatus) -> None:
        if state.leader not in (None, first_leader) and not frozen:
            frozen["pid"] = state.leader
            os.kill(frozen["pid"], signal.SIGSTOP)  # the old request stays in flight, pinned

    trigger = stop_leader_at(node, 30)
    request = node.submit(PROMPT, GREEDY, on_progress=trigger)
    wait_until(lambda: trigger.stopped, "the leader to be frozen mid-request")
    publish = InThread(lambda: node.publish(version, weights_of(contents, version), policy="finish_on_old"))
    wait_until(lambda: node.target_version == version, "the seal of the new version")
    before = len(node.recoveries)
    node.add_state_listener(freeze_the_new_leader)
    try:
        os.kill(first_leader, signal.SIGKILL)
        wait_until(
            lambda: len(node.recoveries) > before and node.roles().shadow_ready,
            "the takeover and the shadow started after it",
            300,
        )
    finally:
        node.remove_state_listener(freeze_the_new_leader)
    assert node.recoveries[before].kind == "takeover" and node.recoveries[before].weights_version == old
    assert not request.done()
    assert node.roles().shadow_version == old, (
        "the new shadow must start on the version the drain is pinned to"
    )
    os.kill(frozen["pid"], signal.SIGKILL)
    result = request.result(300)
    assert node.recoveries[before + 1].kind == "takeover"
    assert node.recoveries[before + 1].weights_version == old
    assert set(result.versions) == {old} and result.token_ids == unfailed
    assert publish.result().drained_requests == 1


def test_a_shadow_that_failed_a_switch_never_takes_over(node):
    """A shadow whose switch failed is replaced on the loop's next iteration; a leader
    failure before that must not promote it: a failed switch may have left its weights
    half replaced whatever version it reports. Its state is set here as `_on_switched`
    leaves it, on a shadow that still reports the version the node serves."""
    before = len(node.recoveries)
    node.holders.shadow.switch_failed = True
    os.kill(node.holders.leader.pid, signal.SIGKILL)
    wait_until(lambda: len(node.recoveries) > before, "the recovery")
    event = node.recoveries[before]
    assert event.kind == "cold_start", event
    assert "switch" in event.fallback_reason, event
    assert set(node.generate(PROMPT, GREEDY, timeout=300).versions) == {node.target_version}


def test_the_owners_background_check_verifies_the_version_a_drain_is_pinned_to(node, contents):
    """While a finish-on-old drain finishes requests on the old version, the leader reads
    that version's segment in place (shared mode): the owner's background check must
    re-verify it, and a damaged one ends the drain with a cold start on the new version."""
    old = node.target_version
    version = next_version(node)
    trigger = stop_leader_at(node, 30)
    request = node.submit(PROMPT, GREEDY, on_progress=trigger)
    wait_until(lambda: trigger.stopped, "the leader to be frozen mid-request")
    before = len(node.recoveries)
    publish = InThread(lambda: node.publish(version, weights_of(contents, version), policy="finish_on_old"))
    wait_until(lambda: node.target_version == version, "the seal of the new version")
    assert node.publisher.pinned_versions() == {old}
    flip_a_weight_byte(node.owner_role.versions[old])
    wait_until(lambda: len(node.recoveries) > before, "the background check to find the damaged segment", 60)
    event = node.recoveries[before]
    assert event.kind == "cold_start" and "checksum" in event.reason and f"version {old}" in event.reason, (
        event
    )
    result = request.result(300)
    on_old = result.versions.count(old)
    assert on_old >= 30 and result.versions == [old] * on_old + [version] * (len(result.versions) - on_old)
    assert publish.result().version == version
