"""One policy per stack: every publish records the weights in the stack's object store, and
a node that starts without a newer memory of its own (a node added after a training run,
one whose state directory is gone) comes up on them, so a turn samples the same policy
whichever node it lands on. Real object store; stand-in nodes record what they were given
(a real node's restore: tests/rollout/test_publish_activity.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from temporalio.testing import ActivityEnvironment

from belayer.activities.publish import PublishActivities
from belayer.contracts.publish import STACK_WEIGHTS_KEY, PublishWeightsArgs
from belayer.rollout.publish import PublishReport
from belayer.storage.weights import store_weights


@dataclass
class RecordingNode:
    """A node that takes every publish and serves its version."""

    node_id: str
    version: int = 1
    given: list[tuple[int, dict]] = field(default_factory=list)
    model_dir: Path = Path("/nowhere")

    @property
    def config(self):
        return SimpleNamespace(node_id=self.node_id)

    def roles(self):
        return SimpleNamespace(
            node_id=self.node_id, weights_version=self.version, leader_version=self.version
        )

    def publish(self, version: int, tensors: dict, policy: str | None = None) -> PublishReport:
        previous, self.version = self.version, version
        self.given.append((version, tensors))
        return PublishReport(version, previous, policy or "continue_on_new", 0.0, 0.0, 0.0, 0.0, 0, 0)


def weights(seed: int) -> dict:
    return {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))}


async def publish(acts: PublishActivities, version: int, ref) -> None:
    await ActivityEnvironment().run(acts.publish_weights, PublishWeightsArgs(version=version, weights=ref))


async def test_a_node_added_after_a_publish_comes_up_on_the_stacks_weights(store, tmp_path):
    first = RecordingNode("first")
    trained = store_weights(store, "weights/v5.safetensors", weights(5))
    await publish(PublishActivities(first, store, tmp_path / "first.json"), 5, trained)

    added = RecordingNode("added")  # no memory of its own: a node the stack grew by
    acts = PublishActivities(added, store, tmp_path / "added.json")
    restored = acts.restore()
    assert restored is not None and restored.version == 5 and added.version == 5
    assert torch.equal(added.given[0][1]["w"], weights(5)["w"])
    assert (tmp_path / "added.json").is_file(), "it now remembers serving them itself"
    assert acts.restore() is None, "nothing to do once the node serves them"


async def test_the_newest_of_the_nodes_memory_and_the_stacks_record_wins_and_never_goes_back(store, tmp_path):
    node = RecordingNode("n")
    v3, v4 = (store_weights(store, f"weights/v{v}.safetensors", weights(v)) for v in (3, 4))
    await publish(PublishActivities(node, store, tmp_path / "n.json"), 3, v3)
    other = RecordingNode("other", version=3)
    await publish(PublishActivities(other, store, tmp_path / "other.json"), 4, v4)
    # `n` restarts with its memory (v3) older than the stack's record (v4).
    restarted = RecordingNode("n")
    assert PublishActivities(restarted, store, tmp_path / "n.json").restore().version == 4

    late = RecordingNode("late", version=2)  # a lagging node's late publish of v3
    await publish(PublishActivities(late, store, tmp_path / "late.json"), 3, v3)
    assert PublishActivities(RecordingNode("fresh"), store).stack_weights().version == 4
    assert store.exists(STACK_WEIGHTS_KEY)


async def test_a_stack_nobody_published_to_leaves_a_new_node_on_its_built_model(store, tmp_path):
    node = RecordingNode("n")
    assert PublishActivities(node, store, tmp_path / "n.json").restore() is None and node.given == []
