"""A trajectory on the real vLLM engine survives its primary engine killed mid-turn:
the node's shadow takes over, and the trajectory's tokens and workspace are identical
to an undisturbed run."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from belayer.storage.store import open_store
from belayer.storage.tokenlog import read_marks
from belayer.workloads.models import TraceTask, TraceTurn
from tests.rollout.conftest import node_config, started_node, tiny_model  # noqa: F401 (fixture)
from tests.workflows.conftest import trajectory_stack
from tests.workflows.test_trajectory import start, wait_for_step

LONG_THINKING = TraceTask(
    id="thinking",
    setup=["mkdir -p /workspace/t"],
    turns=[
        TraceTurn(think_tokens=160, bash=f"echo turn {i} >> /workspace/t/log && wc -l < /workspace/t/log")
        for i in range(1, 6)
    ],
    check="test $(wc -l < /workspace/t/log) = 5",
)


@pytest.fixture(scope="module")
def real_node(tiny_model):
    yield from started_node(node_config(max_model_len=2048), tiny_model)


async def test_primary_engine_killed_mid_turn(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path, real_node
):
    node = real_node.node
    async with trajectory_stack(stack_config, storage_config, tokenizer_path, rollout_node=node) as stack:
        reference = await (await start(stack, LONG_THINKING)).result()
        assert reference.status == "completed", reference.reason
        takeovers_before = len(node.recoveries)
        handle = await start(stack, LONG_THINKING)
        await wait_for_step(handle, 2)
        await asyncio.sleep(0.3)  # inside turn 3's generation
        leader = node.pids()["leader"]
        real_node.remember()
        os.kill(leader, signal.SIGKILL)
        result = await handle.result()
    assert result.status == "completed", result.reason
    assert len(node.recoveries) > takeovers_before
    assert node.recoveries[-1].kind == "takeover"
    assert (result.token_sha256, result.env_sha256) == (reference.token_sha256, reference.env_sha256)
    assert reference.recovered_turns == [] and reference.tokens_after_recovery == 0
    if node.recoveries[-1].replayed_requests:  # the kill landed inside a turn, not between two
        (recovered,) = result.recovered_turns
        assert recovered.replay.outcome == "same" and not result.recovered_tokens_differ
        # Counted: the recovered turn's tokens from the takeover on, and every later turn's.
        model_turns = [
            s
            for s in read_marks(open_store(storage_config, encrypted=False), result.context)
            if s.source == "model"
        ]
        later = sum(s.end - s.start for s in model_turns[recovered.turn :])
        assert result.tokens_after_recovery == recovered.replay.tokens_after + later > later
    assert node.wait_shadow_ready(), "no fresh shadow after the takeover"
