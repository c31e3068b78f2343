"""The task kinds Belayer knows: kind -> driver.

Registering a kind is one entry in `DRIVERS`: the `Task` union (`models.py`) is built from
it, so the workload loader validates tasks of that kind into the driver's model, and the
workflows drive them through `driver_for`. Pure and deterministic: imported inside workflow code.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from belayer.errors import BelayerError
from belayer.workloads.drivers import HarborDriver, ModelDriver, TaskDriver, TraceDriver
from belayer.workloads.tasks import TaskBase

DRIVERS: tuple[TaskDriver, ...] = (TraceDriver(), ModelDriver(), HarborDriver())
_BY_KIND: dict[str, TaskDriver] = {driver.kind: driver for driver in DRIVERS}
# The kind of a task that names none and has no field implying another kind.
DEFAULT_KIND = ModelDriver.kind
KINDS: tuple[str, ...] = tuple(_BY_KIND)


class UnknownTaskKind(BelayerError):
    """A task names a kind no driver is registered for."""


def driver_for_kind(kind: str) -> TaskDriver:
    """The driver registered for `kind`, or `UnknownTaskKind` naming the kinds there are."""
    try:
        return _BY_KIND[kind]
    except (KeyError, TypeError):
        raise UnknownTaskKind(f"unknown task kind {kind!r}: use one of {', '.join(KINDS)}") from None


def driver_for(task: TaskBase) -> TaskDriver:
    """The driver of a validated task (every task model has its `kind` field)."""
    return driver_for_kind(getattr(task, "kind", None))


def task_kind(value: Any) -> str | None:
    """The kind a task (validated or raw) is of: its `kind`, else the kind a field it has
    implies (`turns`: a trace), else the default kind."""
    if isinstance(value, BaseModel):
        return getattr(value, "kind", None)
    if not isinstance(value, dict):
        return None
    if "kind" in value:
        return value["kind"]
    implied = (
        driver.kind for driver in DRIVERS if driver.implied_by is not None and driver.implied_by in value
    )
    return next(implied, DEFAULT_KIND)
