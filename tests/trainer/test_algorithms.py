"""The algorithm seam: each registered algorithm's advantages, the refusal of an unknown
name, the halves the workflow imports staying torch-free, and the trainer taking the
loss of the algorithm its settings name."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from belayer.model.build import model_path
from belayer.storage.weights import load_weights
from belayer.trainer import algorithms
from belayer.trainer.algorithms import ALGORITHMS, Algorithm, UnknownAlgorithm, algorithm, grpo, rloo
from belayer.trainer.algorithms.base import TokenTerms
from belayer.trainer.models import TrainerSettings
from belayer.trainer.step import Trainer
from belayer.trainer.update import KL_TOKEN_BOUND, bounded_k3

from .conftest import batch, step_args

ALGORITHMS_DIR = Path(algorithms.__file__).parent


def test_grpo_normalises_each_reward_by_its_groups_mean_and_spread():
    assert grpo.advantages([1.0, 0.0]) == [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)]
    assert grpo.advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_rloo_takes_each_reward_against_the_mean_of_the_others():
    assert rloo.advantages([1.0, 0.0, 0.5]) == [0.75, -0.75, 0.0]
    assert rloo.advantages([2.0, 0.0]) == [2.0, -2.0]  # not scaled by the spread, unlike GRPO
    assert rloo.advantages([0.3, 0.3]) == [0.0, 0.0]


@pytest.mark.parametrize(("advantage", "clipped"), [(1.0, 1), (-1.0, 2), (0.0, 0)])
def test_a_token_counts_as_clipped_only_where_the_clip_decides_the_loss_as_trl_counts(advantage, clipped):
    """Ratios 0.5, 0.7, 1.0, 1.5 and a masked 0.1 at eps 0.2: above the band only a positive
    advantage is clipped, below it only a negative one (the other side keeps the unclipped,
    smaller term); a masked token never counts."""
    old = torch.zeros(5)
    logp = torch.tensor([0.5, 0.7, 1.0, 1.5, 0.1]).log()
    terms = TokenTerms(logp=logp, old=old, mask=torch.tensor([1.0, 1, 1, 1, 0]), advantage=advantage)
    _, counted = grpo.clipped_surrogate(terms, TrainerSettings(clip_eps=0.2), tokens=4)
    assert counted == clipped


def test_grpo_is_the_default_and_an_unknown_algorithm_is_refused_naming_the_known_ones():
    assert TrainerSettings().algorithm == "grpo"
    assert TrainerSettings(algorithm="rloo").algorithm == "rloo"
    with pytest.raises(ValidationError, match="unknown algorithm 'ppo'; known: grpo, rloo"):
        TrainerSettings(algorithm="ppo")
    with pytest.raises(UnknownAlgorithm, match="known: grpo, rloo"):
        algorithm("ppo")


def test_every_algorithm_is_registered_under_its_own_name():
    assert sorted(ALGORITHMS) == ["grpo", "rloo"]
    assert all(a.name == name for name, a in ALGORITHMS.items())


def test_the_algorithms_import_no_torch_so_the_training_workflow_can_import_them():
    """Only under TYPE_CHECKING: the workflow sandbox imports this package for the advantages."""
    for path in sorted(ALGORITHMS_DIR.glob("*.py")):
        # Module level only: a TYPE_CHECKING block is an `if` statement, not an import.
        for node in ast.parse(path.read_text()).body:
            assert "torch" not in _top_level_imports(node), f"{path.name} imports torch"


def _top_level_imports(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    if isinstance(node, ast.ImportFrom):
        return {(node.module or "").split(".")[0]}
    return set()


@pytest.fixture(scope="module")
def trainer():
    return Trainer(device="cpu")


def _step_weights(trainer, store, samples, **settings) -> dict:
    result = trainer.step(store, step_args(f"algo-{uuid.uuid4().hex[:8]}", samples, **settings))
    return load_weights(store, result.checkpoint.weights)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_trainer_takes_the_loss_of_the_algorithm_its_settings_name(trainer, store, monkeypatch):
    samples = batch(store)
    grpo_weights = _step_weights(trainer, store, samples)
    # RLOO shares GRPO's loss: on the same samples (the same advantages) the update is the same.
    assert _same(_step_weights(trainer, store, samples, algorithm="rloo"), grpo_weights)
    # A loss with no gradient leaves the weights as they were built, so the step used it.
    monkeypatch.setitem(ALGORITHMS, "still", Algorithm("still", grpo.advantages, _no_gradient))
    assert _same(_step_weights(trainer, store, samples, algorithm="still"), _built_weights())
    # The same trajectories with RLOO's advantages (conftest.batch's rewards through its
    # estimator) instead of GRPO's: another update.
    advantages = rloo.advantages([1.0, 0.0, 0.5]) + rloo.advantages([0.0, 1.0])
    rloo_samples = [s.model_copy(update={"advantage": a}) for s, a in zip(samples, advantages, strict=True)]
    assert not _same(_step_weights(trainer, store, rloo_samples, algorithm="rloo"), grpo_weights)


def _built_weights() -> dict:
    return load_file(str(model_path("tiny") / "model.safetensors"))


def _no_gradient(terms, settings, tokens):
    return (terms.logp * 0.0).sum(), 0


def test_minibatches_are_a_seeded_shuffle_of_the_batch_not_whole_groups_in_order():
    from belayer.trainer.update import minibatch_slices

    batch = [f"g{g}-m{m}" for g in range(4) for m in range(2)]  # as the workflow lists a batch
    slices = minibatch_slices(batch, 2, seed=11)
    assert sorted(s for part in slices for s in part) == sorted(batch) and [len(p) for p in slices] == [4, 4]
    assert slices != [batch[:4], batch[4:]], "contiguous slices would hold whole groups in order"
    assert minibatch_slices(batch, 2, seed=11) == slices, "the same seed, the same minibatches"
    assert minibatch_slices(batch, 2, seed=12) != slices


def test_the_kl_term_stays_bounded_where_the_policy_left_the_reference_far_behind():
    """k3 = exp(r) - r - 1 of r = log(reference / policy) is unbounded: a token sampled at a
    tiny probability that the reference liked once gave a KL of 18,796 and a gradient norm
    of 54,685. Each token's term is bounded, and so is its gradient."""
    log_ratio = torch.tensor([-60.0, -1.0, 0.0, 1.0, 12.0, 200.0], requires_grad=True)
    k3 = bounded_k3(log_ratio)
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(log_ratio.grad).all()
    # inside the bounds it is k3 itself; past them, the bound, with no gradient
    inside = torch.tensor([-1.0, 0.0, 1.0])
    assert torch.allclose(k3[1:4], torch.exp(inside) - inside - 1)
    assert k3[4] == k3[5] == KL_TOKEN_BOUND and log_ratio.grad[4] == log_ratio.grad[5] == 0
    assert k3[0] == KL_TOKEN_BOUND  # 59 from a policy far more sure than its reference
