"""`belayer bench turn-overhead`: the split of a workflow's turn loop from its activity
spans, the schedule, and the summary; its run on the real stack is in
tests/training/test_turn_overhead_stack.py."""

from __future__ import annotations

import click
import pytest

from belayer.bench.turn_overhead import (
    ActivitySpan,
    LoopSplit,
    PlainRun,
    schedule,
    split_turn_loop,
    summarize,
)
from belayer.workloads.models import TraceTask, TraceTurn


def turn(at: float, gen_work: float = 0.2, action_work: float = 0.01) -> list[ActivitySpan]:
    """One turn starting at `at` and lasting 0.34 s: each activity waits 10 ms to start, its
    completion waits 20 ms for the next scheduling; `generate` and `exec` spend 5 ms beyond
    their work and `append_observation` spends 30 ms."""
    spans, t = [], at
    for name, busy in (
        ("generate", gen_work + 0.005),
        ("sandbox.exec", action_work + 0.005),
        ("append_observation", 0.03),
    ):
        work = {"generate": gen_work, "sandbox.exec": action_work}.get(name, 0.0)
        spans.append(
            ActivitySpan(name, scheduled=t, started=t + 0.01, completed=t + 0.01 + busy, work_s=work)
        )
        t += 0.01 + busy + 0.02
    return spans


def test_the_split_tiles_the_turn_loop_window():
    before = [ActivitySpan("start_context", 0.0, 0.01, 0.05), ActivitySpan("sandbox.create", 0.07, 0.08, 1.0)]
    turns = turn(1.0) + turn(1.34)
    after = [ActivitySpan("sandbox.exec", 1.68, 1.69, 1.8, work_s=0.05)]
    split = split_turn_loop(after + turns + before, turns=2)  # any order: spans are sorted
    assert split.loop_s == pytest.approx(0.68)
    assert split.dispatch_s == pytest.approx(6 * 0.01)
    assert split.workflow_tasks_s == pytest.approx(6 * 0.02)
    assert split.in_activities_s == pytest.approx(2 * (0.005 + 0.005 + 0.03))
    assert split.work_s == pytest.approx(2 * 0.21)
    parts = split.dispatch_s + split.workflow_tasks_s + split.in_activities_s + split.work_s
    assert parts == pytest.approx(split.loop_s)


def test_with_the_observation_appended_locally_its_time_is_in_the_workflow_task_round():
    """Local context activities leave no activity span: the round after an action then
    lasts the append's 30 ms longer, and the window still ends at the next scheduling."""
    remote = turn(0.0) + turn(0.34) + [ActivitySpan("sandbox.exec", 0.68, 0.69, 0.8)]
    local = [s for s in remote if s.name != "append_observation"]
    as_activity, inside_tasks = split_turn_loop(remote, turns=2), split_turn_loop(local, turns=2)
    assert inside_tasks.loop_s == pytest.approx(as_activity.loop_s)
    assert inside_tasks.workflow_tasks_s == pytest.approx(as_activity.workflow_tasks_s + 2 * (0.01 + 0.03))
    assert inside_tasks.in_activities_s == pytest.approx(as_activity.in_activities_s - 2 * 0.03)


def test_an_append_beside_the_final_check_is_not_waited_for():
    """The last observation appended beside the final check: the window ends when the check
    is scheduled, whichever of the two was scheduled first."""
    loop = turn(0.0) + turn(0.34)[:2]
    first_the_check = loop + [
        ActivitySpan("sandbox.exec", 0.58, 0.59, 0.7),
        ActivitySpan("append_observation", 0.5801, 0.59, 0.62),
    ]
    first_the_append = loop + [
        ActivitySpan("append_observation", 0.5799, 0.59, 0.62),
        ActivitySpan("sandbox.exec", 0.58, 0.59, 0.7),
    ]
    for spans in (first_the_check, first_the_append):
        split = split_turn_loop(spans, turns=2)
        assert split.loop_s == pytest.approx(0.58)
        assert split.workflow_tasks_s >= 0


def test_a_history_shorter_than_the_trace_is_an_error_not_a_figure():
    with pytest.raises(click.ClickException, match="ran 1 actions, the trace has 2 turns"):
        split_turn_loop(turn(0.0), turns=2)
    with pytest.raises(click.ClickException, match="nothing after its last turn"):
        split_turn_loop(turn(0.0), turns=1)


def test_schedule_rotates_the_modes():
    assert schedule(3) == [
        (0, "belayer"),
        (0, "plain"),
        (1, "plain"),
        (1, "belayer"),
        (2, "belayer"),
        (2, "plain"),
    ]


def test_summary_is_per_turn_and_names_the_remainder():
    task = TraceTask(id="t", turns=[TraceTurn(think_tokens=16, bash="true")] * 4)
    belayer = [
        LoopSplit(
            turns=4,
            loop_s=s,
            dispatch_s=0.04,
            workflow_tasks_s=0.08,
            in_activities_s=0.12,
            work_s=s - 0.24,
            start_s=0.9,
            finish_s=0.3,
        )  # fmt: skip
        for s in (1.3, 1.2, 1.4)
    ]
    plain = [
        PlainRun(turns=4, loop_s=s, work_s=s - 0.01, start_s=0.5, finish_s=0.05) for s in (0.8, 0.9, 0.85)
    ]
    report = summarize(belayer, plain, task=task, load={"cores": 2, "load_avg": [0.5, 0.5, 0.5]})
    assert report["belayer_turn_ms"] == {"min": 300.0, "median": 325.0, "max": 350.0}
    assert report["plain_turn_ms"]["median"] == 212.5
    assert report["orchestration_ms_per_turn"] == 112.5
    assert report["orchestration_pct"] == round(112.5 / 212.5 * 100, 1)
    split = report["split_ms_per_turn"]
    assert (
        split["dispatch_ms"]["median"],
        split["workflow_tasks_ms"]["median"],
        split["in_activities_ms"]["median"],
    ) == (10.0, 20.0, 30.0)
    # Belayer's engine and sandbox did the turns' work in 265 ms a turn, the plain loop's in
    # 210: those 55 ms are Belayer's cost too, named; the rest of the 112.5 ms is -2.5
    assert (split["slower_work_ms"], split["other_ms"]) == (55.0, -2.5)
    assert list(report)[:2] == ["bench", "orchestration_pct"]  # the measured share leads
    assert report["per_trajectory_s"]["belayer"]["total_s"]["median"] == pytest.approx(1.2)
    assert report["per_trajectory_s"]["plain"]["start_s"]["median"] == pytest.approx(0.5)
    assert report["accelerator_turn_pct"] == round(112.5 / 1112.5 * 100, 1)
    assert report["repetitions"] == 3 and report["machine"]["cores"] == 2
