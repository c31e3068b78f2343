"""The hang deadline fits the tiny and the bench model on a loaded machine without any
setting: a busy engine (a CPU hog per core) is not declared hung, a real hang (SIGSTOP) is
still caught within the deadline derived from the steps it took before; and after its
owner dies the node is protected again (a takeover possible) on its own."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import time

import pytest

from belayer.model.build import model_path
from belayer.rollout.protocol import SamplingSpec
from tests.rollout.conftest import node_config, owner_recovery_after, started_node
from tests.tiers import needs

PROMPT_TOKENS, NEW_TOKENS, REQUESTS = 512, 64, 4


def _spin() -> None:
    while True:
        pass


@pytest.fixture(scope="module", params=["tiny", "bench"])
@needs("engine")
def loaded_node(request):
    config = node_config(
        model=request.param,
        kv_cache_mb=256,
        max_model_len=1024,
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=120.0,  # only the upper bound
        hang_floor_s=2.0,
    )  # the default, not the shared test nodes' generous one
    yield from started_node(config, model_path(request.param))


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    """Distinct prompts per seed, so that none of them is in the prefix cache."""
    return [
        [(seed * 7919 + r * 104729 + i * 31) % (vocab - 10) + 10 for i in range(PROMPT_TOKENS)]
        for r in range(REQUESTS)
    ]


def _serve(node, seed: int, on_progress=None) -> list:
    spec = SamplingSpec(max_tokens=NEW_TOKENS, temperature=1.0, seed=seed, ignore_eos=True)
    handles = [
        node.submit(p, spec, on_progress=on_progress if i == 0 else None)
        for i, p in enumerate(_prompts(seed, node.vocab_size))
    ]
    return [h.result(600) for h in handles]


def test_a_loaded_engine_is_busy_not_hung_and_a_stopped_one_is_caught(loaded_node):
    node = loaded_node.node
    _serve(node, seed=1)  # the node learns what prefill and decode cost here
    idle = node.roles().hang_deadline
    hogs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 2)]
    for hog in hogs:
        hog.start()
    try:
        loaded = _serve(node, seed=2)  # fresh prompts: full prefills, at a fraction of the CPU
        under_load = node.roles().hang_deadline
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()
    assert all(len(c.token_ids) == NEW_TOKENS for c in loaded)
    assert not node.recoveries, f"a busy engine was declared hung: {node.recoveries[0].reason}"
    assert under_load.decode_step_s >= idle.decode_step_s

    stopped = {}

    def stop_leader(tokens: int) -> None:
        if not stopped and tokens >= NEW_TOKENS // 2:
            stopped.update(pid=node.holders.leader.pid, at=time.monotonic())
            os.kill(stopped["pid"], signal.SIGSTOP)

    results = _serve(node, seed=3, on_progress=stop_leader)
    assert all(len(c.token_ids) == NEW_TOKENS for c in results)
    event = node.recoveries[0]
    assert event.failed_pid == stopped["pid"] and "missed heartbeats" in event.reason
    deadline_s = float(re.search(r"silent for ([0-9.]+) s", event.reason).group(1))
    assert deadline_s < node.config.heartbeat_timeout_s
    assert event.detected_at - stopped["at"] <= deadline_s + 1.0
    print(
        f"hang deadlines ({node.config.model} model): idle {idle}, under load {under_load}, caught a SIGSTOP "
        f"after {event.detected_at - stopped['at']:.2f} s (deadline {deadline_s} s)"
    )


def test_after_its_owner_dies_the_node_is_protected_again(loaded_node):
    node = loaded_node.node
    assert node.wait_shadow_ready()
    generation = node.holders.generation
    os.kill(node.holders.owner.pid, signal.SIGKILL)
    deadline = time.monotonic() + 300
    while not owner_recovery_after(node, generation):
        assert time.monotonic() < deadline, f"not protected again: {node.roles()}"
        time.sleep(0.05)
    again = node.roles().last_owner_recovery
    assert again.owner_generation == node.holders.generation and again.protected_again_s > 0
    assert all(len(c.token_ids) == NEW_TOKENS for c in _serve(node, seed=4))
    print(f"owner death -> protected again ({node.config.model} model): {again.protected_again_s} s")
