"""The fault-point registry: one declaration per point, one switch per variable."""

from __future__ import annotations

import pytest

from belayer import faults


def test_every_point_is_switched_on_by_its_own_variable(monkeypatch):
    monkeypatch.setenv(faults.ENV, "engine_hang:after=40,sandbox_kill_during_exec")
    selected = faults.switched_on()
    assert selected["engine_hang"].number("after", 0) == 40
    assert faults.is_on("sandbox_kill_during_exec") and not faults.is_on("owner_crash")
    assert not faults.is_on("crash_after_checkpoint")  # a trainer point, read from its own variable


def test_a_point_named_in_the_wrong_variable_is_refused():
    with pytest.raises(ValueError, match="unknown trainer fault point 'owner_crash'"):
        faults.parse("owner_crash", faults.TRAINER_ENV)
    with pytest.raises(ValueError, match="unknown rollout or sandbox fault point 'meteor'"):
        faults.parse("meteor", faults.ENV)
