"""The reaper: a sandbox whose workflow has closed, or that Temporal does not know, is removed;
an open workflow's, an unanswered one's and one no workflow started are left alone."""

from __future__ import annotations

from belayer.sandbox.models import Action
from belayer.sandbox.reaper import UNKNOWN, OwnerRecords, owned_sandboxes, reap
from belayer.temporal_client import WORKFLOW_UNKNOWN


def test_owner_records_survive_the_process_and_a_fork_passes_to_its_trajectory(tmp_path):
    owners = OwnerRecords(tmp_path, "host-a")
    owners.record("sbx-0123456789abcdef", "group-1")
    owners.claim("sbx-0123456789abcdef", "group-1/m0")  # the member's first action
    owners.claim("sbx-fedcba9876543210", "traj-x")  # no record: no workflow started it
    again = OwnerRecords(tmp_path, "host-a")  # a restarted worker reads what was recorded
    assert again.all() == {"sbx-0123456789abcdef": "group-1/m0"}
    assert OwnerRecords(tmp_path, "host-b").all() == {}
    assert owned_sandboxes({"sbx-fedcba9876543210"}, again) == {}  # a gone sandbox's record is dropped
    assert again.all() == {}


def test_reap_removes_the_sandboxes_of_closed_and_unknown_workflows_only(sandboxes, tmp_path):
    owners = OwnerRecords(tmp_path, sandboxes.host.host_queue)
    made = {
        name: sandboxes.create() for name in ("terminated", "running", "unknown", "unanswered", "unowned")
    }
    for name, handle in made.items():
        if name != "unowned":
            owners.record(handle.sandbox_id, f"wf-{name}")
    statuses = {"wf-terminated": "TERMINATED", "wf-running": "RUNNING", "wf-unknown": UNKNOWN}

    live = sandboxes.backend.lineages()
    reaped = reap(live, owners, statuses, sandboxes.host.remove)

    assert sorted((r.workflow_id, r.workflow_status) for r in reaped) == [
        ("wf-terminated", "TERMINATED"),
        ("wf-unknown", UNKNOWN),
    ]
    still = sandboxes.backend.lineages()
    for name, handle in made.items():
        assert (handle.sandbox_id in still) == (name in ("running", "unanswered", "unowned")), name
    assert set(owners.all().values()) == {"wf-running", "wf-unanswered"}
    survivor = made["running"]
    assert sandboxes.host.exec(survivor, Action(trajectory="t-reaper", step=1, command="true")).exit_code == 0


def test_the_reaper_and_temporal_client_name_an_unknown_workflow_alike():
    assert UNKNOWN == WORKFLOW_UNKNOWN  # the reaper removes what workflow_status calls unknown
