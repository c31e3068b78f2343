"""The model build is deterministic: same recipe, same bytes."""

import hashlib

import pytest

from belayer.model.build import build_model

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tiny_build_is_byte_identical(tmp_path):
    first = build_model("tiny", tmp_path / "a")
    second = build_model("tiny", tmp_path / "b")
    assert first.name == second.name
    assert _digests(first) == _digests(second)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(_digests(first))


def test_cached_build_is_reused(tmp_path):
    first = build_model("tiny", tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_model("tiny", tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
