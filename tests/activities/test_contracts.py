"""Every activity a worker serves is implemented under a contract, and every contract has
an implementation: the name a workflow schedules is always one some worker registers."""

from __future__ import annotations

import importlib
import pkgutil

from temporalio.common import RawValue

import belayer.activities
import belayer.contracts
from belayer.contracts.activity import Activity


def contracts() -> dict[str, Activity]:
    found = {}
    for module in pkgutil.iter_modules(belayer.contracts.__path__):
        for value in vars(importlib.import_module(f"belayer.contracts.{module.name}")).values():
            if isinstance(value, Activity):
                assert found.setdefault(value.name, value) is value, f"two contracts named {value.name!r}"
    return found


def implementations() -> dict:
    """Activity name -> its Temporal definition, over the classes of belayer/activities/."""
    found = {}
    for module in pkgutil.iter_modules(belayer.activities.__path__):
        classes = [c for c in vars(importlib.import_module(f"belayer.activities.{module.name}")).values()
                   if isinstance(c, type)]  # fmt: skip
        for method in (m for cls in classes for m in vars(cls).values()):
            definition = getattr(method, "__temporal_activity_definition", None)
            if definition is not None:
                assert found.setdefault(definition.name, definition) is definition, f"{definition.name} twice"
    return found


def test_every_contract_is_implemented_and_every_implementation_has_a_contract():
    assert sorted(contracts()) == sorted(implementations())


def test_the_worker_hands_every_implementation_the_raw_payload_for_its_contract_to_read():
    """So the version check runs for every activity (belayer/activities/runtime.py)."""
    for name, definition in implementations().items():
        assert definition.arg_types == ([] if contracts()[name].args is None else [RawValue]), name
