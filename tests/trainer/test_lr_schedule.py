"""The learning rate is a function of the iteration alone, so a resumed trainer steps alike."""

import pytest
import torch

from belayer.trainer.models import TrainerSettings
from belayer.trainer.state import configure, step_lr


def test_constant_by_default_and_linear_decay_to_zero():
    assert [step_lr(TrainerSettings(lr=1e-4), k) for k in (0, 7, 100)] == [1e-4] * 3
    linear = TrainerSettings(lr=1e-4, lr_decay_iterations=4)
    assert [step_lr(linear, k) for k in range(6)] == pytest.approx([1e-4, 7.5e-5, 5e-5, 2.5e-5, 0.0, 0.0])


def test_configure_sets_the_iterations_rate_on_a_kept_optimizer():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    configure(optimizer, TrainerSettings(lr=2e-4, lr_decay_iterations=8, weight_decay=0.1), iteration=2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.5e-4)
    assert optimizer.param_groups[0]["weight_decay"] == 0.1
