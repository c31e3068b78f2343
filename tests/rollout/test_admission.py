"""A node's declared capacity and the shared queue polled only while it has room: no
engine, no Temporal (the node's own admission runs on a real node in test_node.py)."""

from __future__ import annotations

import asyncio
import json

from belayer.rollout.admission import Capacity, kv_tokens
from belayer.rollout.config import RolloutConfig
from belayer.workers.rollout.slots import RoomSlots


def test_capacity_counts_sequences_then_the_kv_tokens_every_open_request_holds():
    capacity = Capacity(sequences=3, kv_tokens=1000)
    assert capacity.refusal([], 1000) is None
    assert capacity.refusal([400, 500], 100) is None
    assert "over its 1000" in capacity.refusal([400, 500], 101)
    assert "3 sequences in flight" in capacity.refusal([1, 1, 1], 1)


def test_kv_tokens_are_the_arenas_bytes_over_each_tokens_keys_and_values(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 768}
    ))  # fmt: skip
    config = RolloutConfig(model="tiny", kv_cache_mb=96, dtype="bfloat16")
    per_token = 2 * 12 * 4 * 64 * 2  # keys and values, layers, KV heads, head size, bytes
    assert kv_tokens(config, tmp_path) == (96 << 20) // per_token


def test_a_full_node_reserves_no_slot_of_the_shared_queue_until_it_has_room():
    room = {"free": False}
    slots = RoomSlots(lambda: room["free"], limit=2)

    async def scenario():
        assert slots.try_reserve_slot(None) is None
        waiting = asyncio.ensure_future(slots.reserve_slot(None))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "a full node polled the shared queue"
        room["free"] = True
        await asyncio.wait_for(waiting, 2)
        assert slots.try_reserve_slot(None) is not None
        assert slots.try_reserve_slot(None) is None  # its own limit
        slots.release_slot(None)
        assert slots.held == 1

    asyncio.run(scenario())
