"""Publishing weights into a running node, on a real engine (tiny model, fp32).

The reference for every version is a node of the same build started from a weights file
holding that version, so "the tokens and logprobs a fresh engine gives" is measured, not
assumed. Published versions alternate between two contents (the built weights and a seeded
perturbation of them) so one node per weight mode serves every test.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch

from belayer.model.build import MANIFEST
from belayer.rollout import publish as publish_module
from belayer.rollout import shm
from belayer.rollout.errors import RolloutError
from belayer.rollout.protocol import SamplingSpec
from belayer.rollout.publish import PublishRefusedError
from belayer.rollout.status import NodeStatus
from tests.rollout.conftest import PROMPTS, flip_a_weight_byte, node_config, pooled_node, started_node

LONG = SamplingSpec(max_tokens=160, ignore_eos=True)
SAMPLED = SamplingSpec(max_tokens=160, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
# Tokens must be identical; logprobs only close: prefill and decode kernels, and batches of
# different make-up, sum in different orders (fp32). CI measured up to 3.6e-4 on a request
# that finished on the old version beside others.
LOGPROB_TOL = 1e-3


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def contents(tiny_model) -> dict[str, dict[str, torch.Tensor]]:
    base = _load(tiny_model)
    gen = torch.Generator().manual_seed(2026)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(base.items())}
    return {"base": base, "perturbed": perturbed}


@pytest.fixture(scope="module")
def perturbed_model(tmp_path_factory, tiny_model, contents) -> Path:
    """The tiny model's files with the perturbed weights: what a fresh engine would load."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("perturbed-model")
    for item in tiny_model.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", MANIFEST):
            shutil.copy(item, out / item.name)
    save_file(contents["perturbed"], str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def references(node_pool, tiny_model, perturbed_model):
    """One node per content, no shadow: the fresh engines every published run is compared to."""
    refs = {}
    gens = [
        pooled_node(node_pool, node_config(shadow=False), tiny_model),
        started_node(node_config(shadow=False), perturbed_model),
    ]
    refs["base"], refs["perturbed"] = (next(g).node for g in gens)
    yield refs
    for g in gens:
        next(g, None)


@pytest.fixture(scope="module", params=["private", "shared"])
def publishing_node(request, node_pool, tiny_model):
    yield from pooled_node(node_pool, node_config(weight_mode=request.param), tiny_model)


class Published:
    """The module node plus which content each version holds."""

    def __init__(self, nut, contents):
        self.nut, self.node, self.contents = nut, nut.node, contents
        self.content_of = {1: "base"}

    def current(self) -> str:
        return self.content_of[self.node.target_version]

    def next_content(self) -> str:
        return "perturbed" if self.current() == "base" else "base"

    def publish(self, policy: str | None = None):
        version, content = self.node.target_version + 1, self.next_content()
        report = self.node.publish(version, self.contents[content], policy=policy)
        self.content_of[version] = content
        self.nut.remember()
        return report


@pytest.fixture
def published(publishing_node, contents) -> Published:
    node = publishing_node.node
    assert node.wait_shadow_ready(), "shadow did not come back"
    state = getattr(publishing_node, "published", None) or Published(publishing_node, contents)
    publishing_node.published = state
    return state


def continuation(reference, prompt, spec, done_tokens):
    """What a fresh engine generates after `prompt + done_tokens` (same absolute positions)."""
    rest = SamplingSpec(**{**spec.__dict__, "max_tokens": spec.max_tokens - len(done_tokens)})
    return reference.generate(list(prompt) + list(done_tokens), rest, timeout=300)


def assert_same_run(result, expected_tokens, expected_logprobs):
    assert result.token_ids == expected_tokens
    assert len(result.logprobs) == len(expected_logprobs)
    worst = max((abs(a - b) for a, b in zip(result.logprobs, expected_logprobs, strict=True)), default=0.0)
    assert worst <= LOGPROB_TOL, f"logprobs differ by up to {worst}"
    assert all(math.isfinite(x) and x <= 0 for x in result.logprobs)


def split_by_version(result) -> list[tuple[int, int]]:
    """[(version, count)] runs, in order."""
    runs: list[tuple[int, int]] = []
    for v in result.versions:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs


def publish_when(node, tokens: int, publish):
    """on_progress: start `publish()` on a thread once the request has `tokens` tokens (the
    callback runs on the node's loop, which a publish waits for)."""
    box: dict = {}

    def on_progress(n: int) -> None:
        if "thread" not in box and n >= tokens:

            def run():
                try:
                    box["report"] = publish()
                except BaseException as exc:  # surfaced by the test
                    box["error"] = exc

            box["thread"] = threading.Thread(target=run)
            box["thread"].start()

    on_progress.box = box
    return on_progress


def finish_publish(trigger):
    box = trigger.box
    assert "thread" in box, "the publish was never started"
    box["thread"].join(300)
    if "error" in box:
        raise box["error"]
    return box["report"]


def test_continue_on_new_pauses_in_flight_requests_and_continues_on_the_new_version(published, references):
    node = published.node
    old, new = published.current(), published.next_content()
    trigger = publish_when(node, 40, lambda: published.publish("continue_on_new"))
    greedy = node.submit(PROMPTS[0], LONG, on_progress=trigger)
    sampled = node.submit(PROMPTS[1], SAMPLED)
    results = [greedy.result(300), sampled.result(300)]
    report = finish_publish(trigger)
    assert report.policy == "continue_on_new" and report.paused_requests >= 1
    assert 0 < report.staged_s <= report.sealed_s <= report.switched_s
    for prompt, spec, result in zip(PROMPTS[:2], (LONG, SAMPLED), results, strict=True):
        runs = split_by_version(result)
        assert [v for v, _ in runs] in ([report.previous_version, report.version], [report.version])
        switched_at = runs[0][1] if len(runs) == 2 else 0
        if switched_at:
            before = references[old].generate(prompt, spec, timeout=300)
            assert_same_run(
                _slice(result, 0, switched_at), before.token_ids[:switched_at], before.logprobs[:switched_at]
            )
        after = continuation(references[new], prompt, spec, result.token_ids[:switched_at])
        assert_same_run(_slice(result, switched_at, None), after.token_ids, after.logprobs)
    roles = node.roles()
    assert roles.leader_version == roles.shadow_version == roles.weights_version == report.version


def test_finish_on_old_finishes_in_flight_on_the_old_version_and_new_requests_wait(published, references):
    node = published.node
    old, new = published.current(), published.next_content()
    trigger = publish_when(node, 30, lambda: published.publish("finish_on_old"))
    in_flight = node.submit(PROMPTS[0], LONG, on_progress=trigger)
    _wait(lambda: node.target_version != node.holders.leader.version, "the seal of the new version")
    assert not in_flight.done(), "the request must still be in flight when the version is sealed"
    later = node.submit(PROMPTS[1], SAMPLED)  # arrives while the old version drains
    first, second = in_flight.result(300), later.result(300)
    report = finish_publish(trigger)
    assert report.drained_requests == 1
    assert set(first.versions) == {report.previous_version}
    expected = references[old].generate(PROMPTS[0], LONG, timeout=300)
    assert_same_run(first, expected.token_ids, expected.logprobs)
    assert set(second.versions) == {report.version}
    expected = references[new].generate(PROMPTS[1], SAMPLED, timeout=300)
    assert_same_run(second, expected.token_ids, expected.logprobs)


def publish_killing_the_leader_once_sealed(published, policy: str, prompt, spec):
    """Publish while `prompt` decodes; SIGKILL the leader right after the owner sealed the
    new version, before the leader computes with it. Returns (result, report, what was seen)."""
    node = published.node
    killed: dict = {}

    def kill_once_sealed(state: NodeStatus) -> None:
        if not killed and state.publishing and state.weights_version != state.leader_version:
            killed["pid"], killed["shadow_version"] = state.leader, state.shadow_version
            os.kill(state.leader, signal.SIGKILL)

    node.add_state_listener(kill_once_sealed)
    try:
        trigger = publish_when(node, 30, lambda: published.publish(policy))
        result = node.submit(prompt, spec, on_progress=trigger).result(300)
        report = finish_publish(trigger)
    finally:
        node.remove_state_listener(kill_once_sealed)
    assert killed, "the leader was never killed during the publish"
    return result, report, killed


def test_primary_killed_during_a_publish_ends_on_the_new_version(published, references):
    node, new = published.node, published.next_content()
    before = len(node.recoveries)
    result, report, _ = publish_killing_the_leader_once_sealed(
        published, "continue_on_new", PROMPTS[2], SAMPLED
    )
    assert node.recoveries[before].weights_version == report.version
    runs = split_by_version(result)
    assert runs[-1][0] == report.version and len(runs) <= 2, runs
    switched_at = sum(n for v, n in runs if v != report.version)
    after = continuation(references[new], PROMPTS[2], SAMPLED, result.token_ids[:switched_at])
    assert_same_run(_slice(result, switched_at, None), after.token_ids, after.logprobs)
    assert node.roles().leader_version == report.version


def test_takeover_while_finish_on_old_drains_finishes_on_the_old_version(published, references):
    node = published.node
    if node.config.weight_mode != "private":
        pytest.skip("the drain path does not depend on the weight mode; run once, in private mode")
    old = published.current()
    before = len(node.recoveries)
    result, report, killed = publish_killing_the_leader_once_sealed(
        published, "finish_on_old", PROMPTS[0], LONG
    )
    assert killed["shadow_version"] == report.previous_version
    event = node.recoveries[before]
    assert event.kind == "takeover" and event.weights_version == report.previous_version
    expected = references[old].generate(PROMPTS[0], LONG, timeout=300)
    assert_same_run(result, expected.token_ids, expected.logprobs)
    assert set(result.versions) == {report.previous_version}
    assert node.roles().leader_version == report.version


def test_a_torn_publish_is_refused_and_nothing_is_served_from_it(published, references, monkeypatch):
    node = published.node
    version, serving = node.target_version + 1, published.current()
    original = publish_module.write_staged

    def torn_write(path, tensors, dtype):
        expected = original(path, tensors, dtype)
        with open(path, "r+b") as f:  # one byte differs from what the publisher hashed
            header = shm.read_weights_header(shm.map_readonly(path))
            f.seek(header.data_offset + 4096)
            byte = f.read(1)
            f.seek(header.data_offset + 4096)
            f.write(bytes([byte[0] ^ 0x01]))
        return expected

    monkeypatch.setattr(publish_module, "write_staged", torn_write)
    with pytest.raises(PublishRefusedError, match="checksum mismatch"):
        node.publish(version, published.contents[published.next_content()])
    assert node.target_version == version - 1 and node.roles().leader_version == version - 1
    assert not [p for p in shm.leftover_segments(node.config.node_id) if p.name.endswith(f"-v{version}")]
    result = node.generate(PROMPTS[1], SAMPLED, timeout=300)
    expected = references[serving].generate(PROMPTS[1], SAMPLED, timeout=300)
    assert_same_run(result, expected.token_ids, expected.logprobs)


def test_owner_crash_during_a_publish_fails_it_and_the_node_keeps_serving(published, references, monkeypatch):
    node = published.node
    if node.config.weight_mode != "shared":
        pytest.skip("run where engines read the owner's memory directly (shared), the harder case")
    serving, generation = published.current(), node.holders.generation
    original = publish_module.write_staged

    def owner_dies_mid_write(path, tensors, dtype):
        owner = node.holders.owner.process
        os.kill(owner.pid, signal.SIGKILL)
        owner.join()
        return original(path, tensors, dtype)

    monkeypatch.setattr(publish_module, "write_staged", owner_dies_mid_write)
    with pytest.raises(RolloutError):
        node.publish(node.target_version + 1, published.contents[published.next_content()])
    monkeypatch.setattr(publish_module, "write_staged", original)
    _wait(
        lambda: node.holders.generation > generation and node.owner_role.failure is None,
        "the replacement owner",
    )
    result = node.generate(PROMPTS[1], SAMPLED, timeout=300)
    expected = references[serving].generate(PROMPTS[1], SAMPLED, timeout=300)
    assert_same_run(result, expected.token_ids, expected.logprobs)
    report = published.publish()  # the replacement owner adopted the segments and publishes
    result = node.generate(PROMPTS[1], SAMPLED, timeout=300)
    assert set(result.versions) == {report.version}


def test_a_published_version_its_new_owner_cannot_adopt_is_restored_from_its_source(published, references):
    """The owner dies and its segment of the served version is damaged: the next owner
    rejects it (checksums) and the node stages that version again from the weight source
    (the trainer's object store in a worker); the node serves it and is protected again."""
    node = published.node
    if node.target_version == 1:
        published.publish()
    serving, version = published.current(), node.target_version
    asked = []

    def source(v):
        asked.append(v)
        return published.contents[published.content_of[v]] if v in published.content_of else None

    node.weight_source = source
    owner, generation = node.holders.owner, node.holders.generation
    os.kill(owner.pid, signal.SIGSTOP)  # frozen while its segment is damaged
    flip_a_weight_byte(node.owner_role.versions[version])
    os.kill(owner.pid, signal.SIGKILL)
    _wait(
        lambda: node.holders.generation > generation and node.roles().protected,
        "the node protected again",
        180,
    )
    assert asked == [version] and node.roles().owner_state == "alive"
    result = node.generate(PROMPTS[1], SAMPLED, timeout=300)
    expected = references[serving].generate(PROMPTS[1], SAMPLED, timeout=300)
    assert_same_run(result, expected.token_ids, expected.logprobs)
    assert set(result.versions) == {version}
    assert published.publish().version == version + 1  # and publishing goes on


def test_a_shadow_behind_the_served_version_never_leads(tiny_model, contents, references, monkeypatch):
    monkeypatch.setenv("BELAYER_FAULT", "publish_switch_fail")  # every shadow's switch fails
    for nut in started_node(node_config(), tiny_model):
        node = nut.node
        behind = node.holders.shadow.pid
        report = node.publish(2, contents["perturbed"])
        nut.remember()
        roles = node.roles()
        assert roles.shadow != behind, "a shadow that failed to switch must be replaced"
        assert roles.shadow_version == roles.leader_version == report.version
        before = len(node.recoveries)
        os.kill(node.holders.leader.pid, signal.SIGKILL)
        result = node.generate(PROMPTS[1], SAMPLED, timeout=300)
        assert node.recoveries[before].weights_version == report.version
        assert behind not in node.pids().values()
        expected = references["perturbed"].generate(PROMPTS[1], SAMPLED, timeout=300)
        assert_same_run(result, expected.token_ids, expected.logprobs)


def test_a_publish_that_does_not_match_the_model_is_refused(published):
    node = published.node
    bad = dict(published.contents["base"])
    bad.pop(sorted(bad)[0])
    with pytest.raises(Exception, match="do not match the served model"):
        node.publish(node.target_version + 1, bad)
    with pytest.raises(Exception, match="not newer"):
        node.publish(node.target_version, published.contents["base"])


def _slice(result, start, end):
    class View:
        token_ids = result.token_ids[start:end]
        logprobs = result.logprobs[start:end]

    return View


def _wait(condition, what: str, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
