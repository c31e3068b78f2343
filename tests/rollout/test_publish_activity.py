"""`rollout.publish_weights` against a real node and a real S3 (SeaweedFS): weights travel
as an object pointer with its sha256, a retry after success is answered without a second
publish, a stale version and an object that does not verify are final errors."""

from __future__ import annotations

import pytest
import torch
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from belayer.activities.publish import PublishActivities, PublishWeightsArgs
from belayer.rollout.protocol import SamplingSpec
from belayer.storage.store import ObjectRef
from belayer.storage.weights import store_weights
from tests.rollout.conftest import node_config, pooled_node, started_node


@pytest.fixture(scope="module")
def lone_node(node_pool, tiny_model):
    for nut in pooled_node(node_pool, node_config(shadow=False), tiny_model):
        yield nut.node  # given back afterwards: closed, and failed on anything it leaked, once published to


def _perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    base = load_file(str(model_dir / "model.safetensors"))
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(base.items())}


async def test_publish_weights_from_the_object_store_and_retries(lone_node, store, tiny_model):
    acts = PublishActivities(lone_node, store)
    env = ActivityEnvironment()
    ref = store_weights(store, "weights/v2.safetensors", _perturbed(tiny_model, 1))
    args = PublishWeightsArgs(version=2, weights=ref, policy="continue_on_new")
    result = await env.run(acts.publish_weights, args)
    assert (result.version, result.previous_version, result.already_published) == (2, 1, False)
    assert 0 < result.sealed_s <= result.switched_s
    assert lone_node.roles().leader_version == 2
    done = lone_node.generate([5, 6, 7], SamplingSpec(max_tokens=8, ignore_eos=True), timeout=300)
    assert set(done.versions) == {2}

    again = await env.run(acts.publish_weights, args)  # the first reply was lost: same answer
    assert again.already_published and again.version == 2

    ref3 = store_weights(store, "weights/v3.safetensors", _perturbed(tiny_model, 2))
    assert (await env.run(acts.publish_weights, PublishWeightsArgs(version=3, weights=ref3))).version == 3
    with pytest.raises(ApplicationError) as stale:  # a late retry of version 2
        await env.run(acts.publish_weights, args)
    assert stale.value.type == "StaleWeightsVersion" and stale.value.non_retryable

    forged = ObjectRef(key=ref.key, size=ref.size, sha256="0" * 64)
    with pytest.raises(ApplicationError) as corrupt:
        await env.run(acts.publish_weights, PublishWeightsArgs(version=4, weights=forged))
    assert corrupt.value.type == "CorruptWeights" and corrupt.value.non_retryable
    assert lone_node.roles().weights_version == 3


async def test_a_restarted_node_comes_back_on_the_version_it_served(store, tiny_model, tmp_path):
    """The node worker remembers each publish; a new node (its shared memory gone with the
    old one) publishes that version into itself before serving, and samples what the old
    one would have; the built model is version 1 and can be published back as a new version."""
    remember = tmp_path / "published.json"
    spec = SamplingSpec(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    ref = store_weights(store, "weights/restart-v2.safetensors", _perturbed(tiny_model, 7))
    with_two = started_node(node_config(shadow=False), tiny_model)
    first = next(with_two).node
    await ActivityEnvironment().run(
        PublishActivities(first, store, remember).publish_weights, PublishWeightsArgs(version=2, weights=ref)
    )
    before = first.generate([5, 6, 7], spec, timeout=300)
    next(with_two, None)  # the node is gone, its segments with it

    restarted = started_node(node_config(shadow=False), tiny_model)
    second = next(restarted).node
    try:
        acts = PublishActivities(second, store, remember)
        assert second.roles().weights_version == 1
        assert acts.restore().version == 2
        assert await ActivityEnvironment().run(acts.weights_version) == 2
        after = second.generate([5, 6, 7], spec, timeout=300)
        assert (after.token_ids, set(after.versions)) == (before.token_ids, {2})
        assert acts.restore() is None, "nothing to do once the node serves it"
        built = await ActivityEnvironment().run(
            acts.publish_weights, PublishWeightsArgs(version=3, weights=None)
        )
        assert built.version == 3
        reference = second.generate([5, 6, 7], spec, timeout=300)
        assert reference.token_ids != before.token_ids, "version 3 is the built model again, not version 2"
    finally:
        next(restarted, None)


async def test_a_node_serves_another_built_model_of_its_layout_by_name(lone_node, store):
    """How a `tiny-warm` run starts on a stack built from `tiny`: the node loads the named
    model from its own model cache; a model not built there is a final error naming the fix."""
    from belayer.model.build import model_path

    acts = PublishActivities(lone_node, store)
    env = ActivityEnvironment()
    version = lone_node.roles().weights_version + 1
    spec = SamplingSpec(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    before = lone_node.generate([5, 6, 7], spec, timeout=300)
    model_path("tiny-warm")  # built by `make install`; builds it otherwise
    result = await env.run(
        acts.publish_weights, PublishWeightsArgs(version=version, weights=None, model="tiny-warm")
    )
    assert result.version == version and lone_node.roles().leader_version == version
    assert lone_node.generate([5, 6, 7], spec, timeout=300).token_ids != before.token_ids

    with pytest.raises(ApplicationError) as missing:
        await env.run(
            acts.publish_weights, PublishWeightsArgs(version=version + 1, weights=None, model="huge")
        )
    assert missing.value.type == "ModelNotBuilt" and missing.value.non_retryable
    assert "belayer model build --size huge" in str(missing.value)
    assert lone_node.roles().weights_version == version
