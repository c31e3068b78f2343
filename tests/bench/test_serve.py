"""`belayer bench serve`'s summary: the overhead, the split of Belayer's calls; its run on
the real stack is in tests/training/test_serve_stack.py."""

from __future__ import annotations

import pytest

from belayer.bench.serve import Conversation, summarize


def conversation(seconds, generate=(), engine=()) -> Conversation:
    return Conversation("p", list(seconds), list(generate), list(engine))


def test_the_overhead_is_the_difference_of_the_medians_and_the_split_tiles_belayers_calls():
    runs = [
        {"belayer": conversation([0.30, 0.40, 0.50], [0.20, 0.25, 0.40], [0.15, 0.2, 0.3]),
         "vllm": conversation([0.10, 0.20, 0.30])},
        {"belayer": conversation([0.35], [0.30], [0.25]), "vllm": conversation([0.12])},
    ]  # fmt: skip
    report = summarize(runs, [0.4, 0.5], model="tiny", max_tokens=32, vllm_start_s=20.0, load={})
    assert report["call_ms"]["belayer"] == {"min": 300.0, "median": 375.0, "max": 500.0}
    assert report["call_ms"]["vllm"]["median"] == pytest.approx(160.0)
    assert report["overhead_ms_per_call"] == pytest.approx(215.0)
    assert report["ratio_belayer_to_vllm"] == pytest.approx(375 / 160, abs=1e-3)
    split = report["belayer_split_ms"]
    assert split["generate_activity"]["median"] == pytest.approx(275.0)
    assert split["of_it_engine"]["median"] == pytest.approx(225.0)
    assert [split["around_it"][k] for k in ("min", "max")] == pytest.approx([50.0, 150.0])
    assert report["calls_per_side"] == 4 and report["conversations"] == 2
