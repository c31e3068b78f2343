"""`belayer serve`'s endpoint over HTTP, on the real vLLM engine (the tiny model), the real
stack and the `openai` package: a call whose engine is killed mid-call answers with the
tokens an undisturbed call gives, a stream carries the same text, and the example agent
(examples/openai_agent.py) gets exactly the tokens `belayer run`'s model-driven loop gets."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from belayer.policy.config import PolicyConfig
from belayer.serve.app import serve_in_background
from belayer.serve.sessions import Sessions
from belayer.temporal_client import connect
from belayer.workflows.models import Sampling
from belayer.workloads.models import ModelTask
from tests.rollout.conftest import node_config, started_node, tiny_model  # noqa: F401 (fixture)
from tests.workflows.conftest import trajectory_stack
from tests.workflows.test_trajectory import start

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent.py"
# The node stores a turn's tokens on its once-a-second heartbeat, and the first store lands
# one to two seconds in: a stream shows growth only for a turn that lasts several seconds
# (about 6 here; 400 tokens, about 2.4 s, came whole when the engine ran fast).
STREAMED_TOKENS = 1000
TASK = ModelTask(id="hello-file", instruction="Create /workspace/hello.txt containing hello, then stop.",
                 max_turns=3, max_tokens_per_turn=48, check="grep -q hello /workspace/hello.txt")  # fmt: skip


@pytest.fixture(scope="module")
def real_node(tiny_model):
    yield from started_node(node_config(max_model_len=2048), tiny_model)


@contextlib.asynccontextmanager
async def endpoint(stack_config, storage_config, tokenizer_path, node):
    """The stack with the real node behind it and the endpoint on a free local port; yields
    (stack, base URL)."""
    async with trajectory_stack(stack_config, storage_config, tokenizer_path, rollout_node=node) as stack:
        temporal = stack_config.temporal.model_copy(update={"workflow_task_queue": stack.queues.context})
        config = stack_config.model_copy(
            update={
                "storage": storage_config,
                "policy": PolicyConfig(mode="every-step"),
                "temporal": temporal,
            }
        )
        sessions = Sessions(config, await connect(config.temporal, config.storage.encryption_key))
        sessions.queues = stack.queues
        try:
            async with serve_in_background(sessions, {TASK.id: TASK}) as url:
                yield stack, url
        finally:
            sessions.close()


async def _decoding(node, asking: asyncio.Future, tokens: int = 20) -> None:
    """Once the call's request has `tokens` tokens on the engine: a kill then lands mid-call."""
    while not any(len(record.tokens) >= tokens for record in node.inflight.open()):
        assert not asking.done(), "the call ended before it was seen decoding"
        await asyncio.sleep(0.01)


async def _session(http: httpx.AsyncClient, seed: int = 0, temperature: float = 1.0) -> str:
    started = await http.post("/sessions", json={"task": TASK.id, "seed": seed, "temperature": temperature})
    assert started.status_code == 200, started.text
    return started.json()["session_id"]


async def test_an_engine_killed_mid_call_answers_with_the_same_tokens(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path, real_node
):
    node = real_node.node
    call = {"model": "tiny", "prompt": "Count: one two three", "max_tokens": 160, "ignore_eos": True,
            "temperature": 1.0, "seed": 11, "return_token_ids": True}  # fmt: skip
    async with (
        endpoint(stack_config, storage_config, tokenizer_path, node) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=300) as http,
    ):
        undisturbed = await http.post(
            "/completions", json=call, headers={"X-Session-ID": await _session(http)}
        )
        assert undisturbed.status_code == 200, undisturbed.text
        takeovers = len(node.recoveries)
        crashed_session = await _session(http)
        asking = asyncio.ensure_future(
            http.post("/completions", json=call, headers={"X-Session-ID": crashed_session})
        )
        await _decoding(node, asking)
        real_node.remember()
        os.kill(node.pids()["leader"], signal.SIGKILL)
        crashed = await asking
        assert crashed.status_code == 200, crashed.text
        # A stream of the same call carries the same text, in OpenAI's chunk format.
        model = AsyncOpenAI(
            base_url=url, api_key="unused", default_headers={"X-Session-ID": await _session(http)}
        )
        # A longer stream of the same call: position-seeded, its first 160 tokens are the same.
        sampling = {
            k: v for k, v in call.items() if k not in ("ignore_eos", "return_token_ids", "max_tokens")
        }
        streamed = await model.completions.create(stream=True, max_tokens=STREAMED_TOKENS, extra_body={"ignore_eos": True},
                                                  **sampling)  # fmt: skip
        chunks = [chunk async for chunk in streamed]
    assert len(node.recoveries) > takeovers and node.recoveries[-1].kind == "takeover"
    first, second = undisturbed.json(), crashed.json()
    assert (
        second["belayer"]["token_ids"] == first["belayer"]["token_ids"]
        and len(first["belayer"]["token_ids"]) == 160
    )
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["belayer"]["engine_recoveries"] and not first["belayer"]["engine_recoveries"]
    texts = [c.choices[0].text for c in chunks if c.choices[0].text]
    assert "".join(texts).startswith(first["choices"][0]["text"])
    assert len(texts) >= 2, "the text came as the turn's stored tokens grew, not all at the end"
    assert chunks[-1].choices[0].finish_reason == first["choices"][0]["finish_reason"] == "length"
    assert chunks[-1].usage.completion_tokens == STREAMED_TOKENS
    assert node.wait_shadow_ready(), "no fresh shadow after the takeover"


async def test_the_example_agent_gets_the_tokens_belayer_runs_loop_gets(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path, real_node
):
    spec = importlib.util.spec_from_file_location("openai_agent", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    async with endpoint(stack_config, storage_config, tokenizer_path, real_node.node) as (stack, url):
        for seed in (3, 4):
            reference = await (
                await start(stack, TASK, sampling=Sampling(seed=seed, temperature=1.0))
            ).result()
            finished = await example.run_agent(url, TASK.id, seed=seed, temperature=1.0)
            assert finished["status"] == reference.status and finished["reward"] == reference.reward
            assert finished["turns"] == reference.turns
            assert finished["token_sha256"] == reference.token_sha256, (
                f"seed {seed}: other tokens than belayer run's"
            )
        async with httpx.AsyncClient(base_url=url) as http:
            no_session = await http.post(
                "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
            unknown = await http.post("/sessions", json={"task": "nope"})
    assert no_session.status_code == 400 and "X-Session-ID" in no_session.json()["error"]["message"]
    assert unknown.status_code == 404 and "hello-file" in unknown.json()["error"]["message"]
