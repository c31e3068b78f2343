"""The suite on several workers (pytest-xdist): which tests run together, in what order, and
how an interrupted parallel run still stops everything it started.

A work unit is the set of tests one worker runs together: those of a session-wide fixture
(the shared whole stack, the node pool), so it starts once; the rest by module, so a
module's fixtures start once and its tests keep their order. A unit depends on the fixtures
a test uses, which only a collecting worker knows, so each worker records the units it
collected (`record_units`) and the controller's scheduler reads them (`UnitScheduling`).
xdist's own `xdist_group` marker cannot carry them: 3.8 renames the test's node id to
group it, and pytest 9 no longer reads that name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil
from xdist.scheduler import LoadScopeScheduling

# The two-host tests and the one-host tests each start a whole stack of their own, so that
# two workers run them side by side (together they take a third of the suite); in one
# process they share one stack, grown to two hosts first (tests/conftest.py).
SHARED_UNITS = {"two_host_stack": "whole-stack-two-hosts", "shared_whole_stack": "whole-stack",
                "node_pool": "node-pool"}  # fmt: skip
# The shared units go first, the longest first (minutes on two workers: 11, 12, 8), so that
# none of them starts late and ends the run alone.
_SHARED_COST = {"whole-stack": 11, "node-pool": 10, "whole-stack-two-hosts": 9}
_TIER_COST = {"whole": 4, "engine": 3, "sandbox": 2, "stack": 1, "pure": 0}
_UNITS_FILE = "BELAYER_TEST_UNITS_FILE"  # set by the controller, written by the workers
WORKER_TEARDOWN_S = 300  # a whole stack and a node pool going down on a loaded machine, with margin


def is_controller(config) -> bool:
    """Whether this process hands tests to workers (and runs none itself)."""
    return config.option.dist != "no" and not hasattr(config, "workerinput")


def is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def configure_controller() -> None:
    """Where the workers record their units; how a signal stops the run."""
    os.environ[_UNITS_FILE] = str(Path(tempfile.mkdtemp(prefix="belayer-units-")) / "units.json")
    signal.signal(signal.SIGTERM, _stop_after_workers)
    signal.signal(signal.SIGINT, _stop_after_workers)


def unconfigure_controller() -> None:
    shutil.rmtree(Path(os.environ.pop(_UNITS_FILE)).parent, ignore_errors=True)


def work_unit(item) -> str:
    for fixture, unit in SHARED_UNITS.items():
        if fixture in item.fixturenames:
            return unit
    return item.nodeid.split("::")[0]


def order_and_record_units(items) -> None:
    """In a worker: the heaviest units first (the shared ones, then by tier), so the run does
    not end on one worker busy with a long unit while the other idles; within a unit the
    order stays. Then record every test's unit for the controller."""
    units = {id(item): work_unit(item) for item in items}
    cost: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        unit = units[id(item)]
        tiers = [_TIER_COST[m.name] for m in item.iter_markers() if m.name in _TIER_COST]
        cost[unit] = max(cost.get(unit, 0), _SHARED_COST.get(unit, 0), *tiers)
        first.setdefault(unit, index)
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-cost[units[id(item)]], first[units[id(item)]], order[id(item)]))
    path = Path(os.environ[_UNITS_FILE])
    written = path.with_name(f"{path.name}.{os.getpid()}")
    written.write_text(json.dumps({item.nodeid: units[id(item)] for item in items}))
    written.replace(path)  # every worker collects the same tests: whichever lands last is as good


class UnitScheduling(LoadScopeScheduling):
    """xdist's load-scope scheduling with the units the workers recorded as scopes: a unit is
    handed out whole, in collection order, to the worker that runs low."""

    _units: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:
            self._units = json.loads(Path(os.environ[_UNITS_FILE]).read_text())
        return self._units.get(nodeid, nodeid)


def _stop_after_workers(signum, frame) -> None:
    """In a parallel run's controller (whose only children are its workers): interrupt the
    workers (Ctrl-C in a terminal already did: SIGINT reaches the whole process group), wait
    until none has a process of its own left, then stop as Ctrl-C does. Stopped at once,
    the controller would leave xdist to end each worker 10 s later, halfway through
    stopping a whole stack."""
    workers = psutil.Process().children()
    if signum == signal.SIGTERM:
        for worker in workers:
            with contextlib.suppress(psutil.Error):
                worker.send_signal(signal.SIGINT)
    deadline = time.monotonic() + WORKER_TEARDOWN_S
    while any(_runs_processes(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    raise KeyboardInterrupt


def _runs_processes(worker: psutil.Process) -> bool:
    """Whether the worker still has a process of its own running: a zombie it has not
    reaped yet, or multiprocessing's resource tracker (which lives as long as the worker),
    is none."""
    try:
        children = worker.children()
    except psutil.Error:  # the worker is gone
        return False
    return any(_running(child) for child in children)


def _running(process: psutil.Process) -> bool:
    try:
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return "multiprocessing.resource_tracker" not in " ".join(process.cmdline())
    except psutil.Error:
        return False
