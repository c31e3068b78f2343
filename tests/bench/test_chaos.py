"""`belayer bench chaos`'s summary on recorded faults and trajectories: a soak's rounds are
its repetitions, so recovery times and round wall times come as min / median / max. (The
soak itself injects real faults: `belayer bench chaos` on a stack of your own.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from belayer.chaos import leaks
from belayer.chaos.faults import ChaosError
from belayer.chaos.soak import (
    SOAK_FAULT_KINDS,
    FaultRecord,
    ScheduledFault,
    Soak,
    SoakSettings,
    TrajectoryOutcome,
    default_kinds,
    recovery_figures,
    round_wall_s,
)
from belayer.cli.bench.chaos import chosen_kinds, print_report
from belayer.config import BelayerConfig
from belayer.stack import sandbox_hosts

EXAMPLE = Path(__file__).parents[2] / "examples" / "workloads" / "build-and-serve.yaml"


def fault(kind: str, recovery_s: float | None, *, injected: bool = True, round: int = 1) -> FaultRecord:
    return FaultRecord(
        kind=kind, round=round, target="t", trigger="step=1", injected=injected, recovery_s=recovery_s
    )


def outcome(round: int, started_at: float, ended_at: float | None) -> TrajectoryOutcome:
    return TrajectoryOutcome(
        id=f"r{round}-{started_at}",
        task="t",
        round=round,
        status="completed",
        verdict="ok",
        started_at=started_at,
        ended_at=ended_at,
    )


FAULTS = [
    fault("engine-crash", 2.0),
    fault("engine-crash", 6.0),
    fault("engine-crash", 4.0, round=2),
    fault("s3-outage", 3.0),
    fault("s3-outage", None),
    fault("sandbox-crash", 9.0, injected=False),
]


def test_recovery_is_spread_per_kind_and_over_all_beside_the_percentiles():
    figures = recovery_figures(
        [f for f in FAULTS if f.injected], ["engine-crash", "s3-outage", "sandbox-crash"]
    )
    engine = figures["by_kind"]["engine-crash"]
    assert engine == {
        "injected": 3,
        "p50_recovery_s": 4.0,
        "max_recovery_s": 6.0,
        "recovery_s_spread": {"min": 2.0, "median": 4.0, "max": 6.0},
    }
    assert figures["by_kind"]["s3-outage"]["recovery_s_spread"] == {"min": 3.0, "median": 3.0, "max": 3.0}
    assert figures["by_kind"]["s3-outage"]["injected"] == 2  # one never saw its trajectory step again
    assert figures["by_kind"]["sandbox-crash"] == {
        "injected": 0,
        "p50_recovery_s": None,
        "max_recovery_s": None,
        "recovery_s_spread": None,
    }
    assert figures["recovery_s_spread"] == {"min": 2.0, "median": 3.5, "max": 6.0}
    assert (figures["p50_recovery_s"], figures["p99_recovery_s"]) == (3.0, 6.0)  # nearest rank
    assert recovery_figures([], ["engine-crash"])["recovery_s_spread"] is None


def test_a_round_lasts_from_its_first_start_to_its_last_end():
    outcomes = [
        outcome(2, 100.0, 130.0),
        outcome(1, 10.0, 40.0),
        outcome(1, 12.0, 55.5),
        outcome(2, 101.0, None),
    ]
    assert round_wall_s(outcomes) == [45.5, 30.0]
    assert round_wall_s([]) == []


def test_the_table_shows_min_median_max_per_kind_and_over_all(capsys):
    figures = recovery_figures([f for f in FAULTS if f.injected], ["engine-crash", "sandbox-crash"])
    summary = {
        "rounds_run": 2,
        "by_kind": figures["by_kind"],
        "faults_injected": 5,
        "recovery_s_spread": figures["recovery_s_spread"],
        "p50_recovery_s": 3.0,
        "p99_recovery_s": 6.0,
        "round_wall_s_spread": {"min": 30.0, "median": 37.8, "max": 45.5},
        "trajectories": 4,
        "lost": 0,
        "terminated": 0,
        "mismatched": 0,
        "failed_infra": 0,
        "context_cuts": 0,
        "leaked": {},
    }
    print_report(summary)
    lines = [" ".join(line.replace("│", " ").split()) for line in capsys.readouterr().out.splitlines()]
    assert "engine-crash 3 2.00 4.00 6.00" in lines and "sandbox-crash 0 - - -" in lines
    assert "all 5 2.00 3.50 6.00" in lines
    assert "round wall time 30.00 / 37.80 / 45.50 s (min / median / max)" in lines


def hashed(
    task: str, *, member: int | None = None, status: str = "completed", token: str = "t1"
) -> TrajectoryOutcome:
    return TrajectoryOutcome(id=f"{task}-{member}", task=task, round=1, member=member, status=status,
                             verdict="", started_at=0.0, token_sha256=token, env_sha256="e1")  # fmt: skip


def test_the_soak_terminating_a_trajectory_is_its_own_verdict_and_members_meet_their_own_reference(tmp_path):
    """A trajectory the soak's `terminate` fault ended is counted apart, never as lost; a
    group member is compared with the reference round's member in the same place, a lone
    trajectory with the lone reference."""
    soak = Soak(BelayerConfig(state_dir=tmp_path), SoakSettings(workloads=[EXAMPLE], group_size=2))
    soak.references = {("a", None): hashed("a"), ("a", 1): hashed("a", member=1, token="t2")}
    assert soak._verdict(hashed("a", status="terminated", token=None)) == "terminated"
    assert soak._verdict(hashed("a", status="lost", token=None)) == "lost"
    assert soak._verdict(hashed("a", member=1, token="t2")) == "ok"
    assert soak._verdict(hashed("a", member=1, token="t1")) == "mismatched"  # another member's tokens
    assert soak._verdict(hashed("a", token="t2")) == "mismatched"
    assert soak._verdict(hashed("a", member=0)) == "mismatched"  # no reference of that place


def test_drain_is_drawn_only_where_a_second_host_can_take_the_sandboxes(tmp_path):
    assert "drain" not in default_kinds(1) and "terminate" in default_kinds(1)
    assert default_kinds(2) == list(SOAK_FAULT_KINDS)
    assert chosen_kinds(None, 2) == list(SOAK_FAULT_KINDS) and "drain" not in chosen_kinds(None, 1)
    with pytest.raises(ChaosError, match="--sandbox-hosts 2"):
        chosen_kinds("engine-crash,drain", 1)
    with pytest.raises(ChaosError, match="unknown fault kind"):
        chosen_kinds("engine-crush", 2)


def test_leaks_are_counted_from_the_hosts_directories_and_namespaces(tmp_path):
    """A finished sandbox's channel directory on any host, an archive left being imported,
    and a network namespace no live process explains are each a leak."""
    config = BelayerConfig(state_dir=tmp_path)
    channels = sandbox_hosts.host_dir(config, 0) / "channels"
    (channels / "sbx-done").mkdir(parents=True)
    (channels / "sbx-live").mkdir()
    assert leaks.channel_dirs_of(config, {"sbx-done"}) == [str(channels / "sbx-done")]
    importing = tmp_path / "tmp" / "imports" / "belayer-sandbox-h" / "restore-x" / "a.tar"
    importing.parent.mkdir(parents=True)
    importing.write_bytes(b"x")
    assert leaks.importing_files(config) == [str(importing)]
    mine = os.stat("/proc/self/ns/net").st_ino
    assert mine in leaks.network_namespaces()
    everything = leaks.Snapshot(
        containers=set(), processes=set(), network_namespaces=set(leaks.network_namespaces())
    )
    assert leaks.new_network_namespaces(everything, set()) == []
    nothing = everything.model_copy(update={"network_namespaces": set()})
    assert f"net:[{mine}]" in " ".join(leaks.new_network_namespaces(nothing, set()))
    assert f"net:[{mine}]" not in " ".join(leaks.new_network_namespaces(nothing, {os.getpid()}))
    assert set(leaks.Leaks().counts()) == {"containers", "processes", "network_namespaces", "shm_segments",
                                           "channel_dirs", "imports", "objects"}  # fmt: skip


def test_a_fault_carried_over_rounds_counts_once_and_only_if_never_injected(tmp_path):
    soak = Soak(BelayerConfig(state_dir=tmp_path), SoakSettings(workloads=[EXAMPLE]))
    carried = "not injected: every trajectory of the round had finished; carried over"
    soak.faults = [
        fault("engine-crash", 2.0),
        fault("drain", None, injected=False).model_copy(update={"recovered_by": carried}),
        fault("drain", 3.0, round=2),  # the same drain, injected a round later
        fault("terminate", None, injected=False).model_copy(update={"recovered_by": carried}),
        fault("s3-outage", None, injected=False).model_copy(update={"recovered_by": "not injected: gone"}),
    ]
    soak.carried = [ScheduledFault(kind="terminate", target=0, step=1)]  # waiting when the last round ended
    summary = soak._summary(leaks.Leaks(), wall_s=1.0)
    assert (summary["faults_injected"], summary["faults_not_injected"]) == (2, 2)
