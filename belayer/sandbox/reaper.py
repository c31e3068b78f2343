"""Nothing a workflow created outlives it: each sandbox's owner, and the reaper that removes a
sandbox whose owner has closed.

A trajectory normally destroys its sandbox as its last act. But a workflow terminated from
Temporal (`temporal workflow terminate`, the web UI's Terminate, a timeout) runs no code of
its own, so nothing destroys it: before the reaper, such a sandbox kept its memory and disk
until `belayer down`.

So every activity that starts a sandbox on a host records, on that host, which workflow it
serves (`OwnerRecords`): the calling workflow for a create or a recovery, each fork's
trajectory for a fork. The sandbox worker asks Temporal, every `sandbox.reap_interval_s`,
how each owner stands, and `reap` removes the sandboxes whose owner is closed (completed,
failed, cancelled, terminated, timed out) or unknown to Temporal, with whatever of them was
captured here and never published. A sandbox with no record (one a program made through
the library, outside any workflow) is never touched: the reaper judges only what
workflows own. A workflow that continued as new keeps its id and stays open.

Records are files under the host's state directory, one per sandbox, so they survive a
restart of the worker; destroying a sandbox removes its record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from belayer.sandbox.models import checked_sandbox_id

log = logging.getLogger(__name__)

OWNERS_DIR = "sandbox-owners"
# Temporal's execution statuses after which a workflow runs no more code (CONTINUED_AS_NEW
# is absent: describing the id finds the new run, which is open).
CLOSED = frozenset({"COMPLETED", "FAILED", "CANCELED", "TERMINATED", "TIMED_OUT"})
UNKNOWN = "UNKNOWN"  # Temporal has no workflow of that id (deleted, or another namespace's);
# the same word as belayer.temporal_client.WORKFLOW_UNKNOWN, which the domain does not import


class OwnerRecords:
    """sandbox id -> the id of the workflow it serves, for the sandboxes of one host."""

    def __init__(self, state_dir: Path, host_queue: str) -> None:
        self.host_queue = host_queue
        self.dir = Path(state_dir) / OWNERS_DIR / host_queue
        self._known: dict[
            str, str | None
        ] = {}  # what this process recorded or read: a turn's claim is a lookup

    def record(self, sandbox_id: str, workflow_id: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / checked_sandbox_id(sandbox_id)
        partial = path.with_suffix(".tmp")
        partial.write_text(workflow_id)
        partial.replace(path)
        self._known[sandbox_id] = workflow_id

    def claim(self, sandbox_id: str, workflow_id: str | None) -> None:
        """`workflow_id` acts on the sandbox: it owns it from now (a fork passing from the
        workflow that forked it to its trajectory). A sandbox without a record is not
        claimed: only what a workflow started is the reaper's."""
        if workflow_id is None or self._known.get(sandbox_id, "") in (workflow_id, None):
            return
        current = self.owner(sandbox_id)
        if current is not None and current != workflow_id:
            self.record(sandbox_id, workflow_id)
        else:
            self._known[sandbox_id] = current  # None: no workflow started it; not looked up again

    def owner(self, sandbox_id: str) -> str | None:
        try:
            return (self.dir / checked_sandbox_id(sandbox_id)).read_text()
        except FileNotFoundError:
            return None

    def forget(self, sandbox_id: str) -> None:
        (self.dir / checked_sandbox_id(sandbox_id)).unlink(missing_ok=True)
        self._known.pop(sandbox_id, None)

    def all(self) -> dict[str, str]:
        if not self.dir.is_dir():
            return {}
        return {path.name: path.read_text() for path in self.dir.iterdir() if path.suffix != ".tmp"}


@dataclass(frozen=True)
class Reaped:
    """A sandbox removed because the workflow it served will never destroy it."""

    sandbox_id: str
    workflow_id: str
    workflow_status: str


def owned_sandboxes(live: Iterable[str], owners: OwnerRecords) -> dict[str, str]:
    """The live sandboxes that have an owner, with it; the records of sandboxes gone are dropped."""
    live = set(live)
    records = owners.all()
    for gone in set(records) - live:
        owners.forget(gone)
    return {sandbox_id: workflow_id for sandbox_id, workflow_id in records.items() if sandbox_id in live}


def reap(live: Iterable[str], owners: OwnerRecords, statuses: dict[str, str],
         remove: Callable[[str], None]) -> list[Reaped]:  # fmt: skip
    """Remove each live, owned sandbox whose owner's status (`statuses`: workflow id ->
    Temporal's status name, or UNKNOWN) is closed or unknown; an owner missing from
    `statuses` (Temporal did not answer) is left for the next round."""
    reaped = []
    for sandbox_id, workflow_id in owned_sandboxes(live, owners).items():
        status = statuses.get(workflow_id)
        if status is None or (status not in CLOSED and status != UNKNOWN):
            continue
        try:
            remove(sandbox_id)
        except Exception as exc:  # one sandbox that will not go must not keep the others
            log.warning(
                "reaper: could not remove sandbox %s of %s workflow %s: %s",
                sandbox_id,
                status,
                workflow_id,
                exc,
            )
            continue
        owners.forget(sandbox_id)
        reaped.append(Reaped(sandbox_id=sandbox_id, workflow_id=workflow_id, workflow_status=status))
    return reaped
