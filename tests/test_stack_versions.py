"""`belayer status` flags a rollout node behind the version another node of the stack
serves: one stack serves one policy."""

from __future__ import annotations

from belayer.stack.local import other_version_flags


def test_a_node_behind_another_is_flagged_with_both_versions():
    flags = other_version_flags({"rollout-node": 5, "rollout-node.1": 1, "rollout-node.2": 5})
    assert list(flags) == ["rollout-node.1"]
    assert flags["rollout-node.1"].startswith("SERVES v1, ANOTHER NODE v5")


def test_nodes_on_one_version_are_not_flagged():
    assert other_version_flags({"rollout-node": 3, "rollout-node.1": 3}) == {}
    assert other_version_flags({}) == {}
