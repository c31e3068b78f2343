"""The warm start: deterministic fine-tuning, and a tiny-warm model that calls tools."""

import dataclasses
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from belayer.model.build import MANIFEST, file_sha256, model_path  # noqa: E402
from belayer.model.learn_tasks import problems  # noqa: E402
from belayer.model.warmstart import RECIPE, Segment, candidates, encode, transcript, warm_state  # noqa: E402


def test_a_few_sft_steps_give_identical_weights():
    import torch

    recipe = dataclasses.replace(RECIPE, steps=3, batch=2, warmup=1)
    base = model_path("tiny")
    first = warm_state(base, recipe, print)
    second = warm_state(base, recipe, print)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    shorter = warm_state(base, dataclasses.replace(recipe, steps=2), print)
    assert not all(torch.equal(first[name], shorter[name]) for name in first)


def test_loss_covers_only_the_model_turns():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path("tiny") / "tokenizer.json"))
    segments = [Segment("Task: add", trained=False), Segment("<bash>ls</bash>", trained=True)]
    ids, labels = encode(tokenizer, segments, eos_id=1)
    prompt = len(tokenizer.encode("Task: add", add_special_tokens=False).ids)
    assert labels[:prompt] == [-100] * prompt
    assert labels[prompt:] == ids[prompt:] and ids[-1] == 1


def test_candidates_are_the_correct_command_and_three_wrong_ones():
    import random

    rng = random.Random(0)
    for problem in problems("train"):
        commands = candidates(problem, rng)
        assert commands[0] == problem.command() and len(set(commands)) == 4


def test_transcripts_vary_the_constant_and_end_with_an_answer():
    import random

    rng = random.Random(0)
    runs = [transcript(i, rng) for i in range(60)]
    assert len({run[1].text for run in runs}) > 50  # the model must read the constant
    assert all(run[-1] == Segment("done", trained=True) for run in runs)


@pytest.fixture(scope="module")
def warm():
    """The cached tiny-warm build (built on first use, ~2 minutes)."""
    return model_path("tiny-warm")


def test_tiny_warm_records_its_recipe_and_base(warm):
    manifest = json.loads((warm / MANIFEST).read_text())
    base = model_path("tiny")
    assert manifest["sft"] == dataclasses.asdict(RECIPE)
    assert manifest["base"] == {"size": "tiny", "manifest_sha256": file_sha256(base / MANIFEST)}
    for name in ("tokenizer.json", "config.json"):
        assert (warm / name).read_bytes() == (base / name).read_bytes()
    assert manifest["files"]["model.safetensors"] == file_sha256(warm / "model.safetensors")


def test_tiny_warm_calls_a_tool_almost_always(warm):
    from belayer.model.evaluate import load, rates

    model, tokenizer = load(warm)
    tasks = problems("train")[:3] + problems("heldout")[:3]
    result = rates(model, tokenizer, tasks, n=8, seed=7)
    assert result.tool_calls >= 0.85 * result.samples, result
    assert 0 < result.correct < result.samples, result


@pytest.fixture(scope="module")
def agent():
    """The cached tiny-agent build (the multistep family's warm start; ~2 minutes)."""
    return model_path("tiny-agent")


def test_tiny_agent_records_its_own_recipe(agent):
    from belayer.model.multistep_tasks import WARM_RECIPE

    manifest = json.loads((agent / MANIFEST).read_text())
    assert manifest["sft"] == dataclasses.asdict(WARM_RECIPE) != dataclasses.asdict(RECIPE)
    assert manifest["base"]["size"] == "tiny"


def test_tiny_agent_solves_multistep_tasks_only_by_reading_its_observations(agent):
    from belayer.model.evaluate import load
    from belayer.model.multistep_eval import success_rate
    from belayer.model.multistep_tasks import problems

    model, tokenizer = load(agent)
    tasks = problems("train")[:12]
    seen = success_rate(model, tokenizer, tasks, 1, seed=3)
    blind = success_rate(model, tokenizer, tasks, 1, seed=3, blank=True)
    assert 0 < seen < 1 and blind <= 0.2 and blind < seen, (seen, blind)
