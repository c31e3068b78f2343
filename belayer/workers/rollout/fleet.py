"""Which rollout nodes a deployment runs, for everything that must reach each one.

A publish has to reach every node (a node left on old weights would serve the next
batch from them), so whoever publishes needs the whole list, not only the node the
configuration names. Node k of a stack has the id `<rollout.node_id>.k` (the first keeps
`rollout.node_id`); how many there are is what the last `belayer up --rollout-nodes N`
recorded in the state directory, else `stack.rollout_nodes`.
"""

from __future__ import annotations

import json
from pathlib import Path

from belayer.config import BelayerConfig


def topology_file(state_dir: Path) -> Path:
    """Where `belayer up` records how many rollout nodes and sandbox hosts it started."""
    return state_dir / "run" / "topology.json"


def recorded_topology(state_dir: Path) -> dict[str, int]:
    """How many rollout nodes and sandbox hosts the last `up` started ({} if none)."""
    try:
        recorded = json.loads(topology_file(state_dir).read_text())
        return {key: int(value) for key, value in recorded.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def rollout_node_ids(config: BelayerConfig, count: int | None = None) -> list[str]:
    """The ids of the deployment's rollout nodes (`count` of them, else as many as it runs):
    rollout.node_id, then <id>.1, <id>.2, ..."""
    count = count or recorded_topology(config.state_dir).get("rollout_nodes") or config.stack.rollout_nodes
    first = config.rollout.node_id
    return [first, *(f"{first}.{k}" for k in range(1, count))]


def node_config(config: BelayerConfig, node_id: str) -> BelayerConfig:
    """`config` as the node `node_id` runs with it."""
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"node_id": node_id})})
