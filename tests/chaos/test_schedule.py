"""The soak's fault schedule and figures: seeded, covering every kind, no stack needed.
(The soak itself runs real faults: `belayer bench chaos` on a stack of your own.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from belayer.chaos.faults import FAULT_KINDS, RECOVERED_BY, TRAINING_FAULT_KINDS, ChaosError
from belayer.chaos.plan import parse_plan, random_plan
from belayer.chaos.soak import SOAK_FAULT_KINDS, SoakSettings, percentile, schedule
from belayer.chaos.training import aimed_at

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "build-and-serve.yaml"


def settings(**kw) -> SoakSettings:
    return SoakSettings(workloads=[EXAMPLE], **kw)


def test_default_soak_covers_every_fault_kind_once_per_cycle():
    plan = schedule(settings(), turns=[6, 4])
    kinds = [f.kind for round_ in plan for f in round_]
    assert set(FAULT_KINDS) <= set(kinds)
    assert len(kinds) == 10 and len(set(kinds[:9])) == 9  # a full shuffle before any repeat


def test_schedule_is_a_function_of_the_seed():
    assert schedule(settings(seed=3), [6, 4]) == schedule(settings(seed=3), [6, 4])
    assert schedule(settings(seed=3), [6, 4]) != schedule(settings(seed=4), [6, 4])


@pytest.mark.parametrize("seed", range(20))
def test_triggers_stay_inside_each_target(seed):
    turns = [6, 4, 1]
    for round_ in schedule(settings(seed=seed, rounds=4, faults_per_round=3), turns):
        for fault in round_:
            assert 0 <= fault.target < len(turns)
            assert (fault.step is None) != (fault.t is None)
            if fault.step is not None:
                assert 1 <= fault.step <= max(1, turns[fault.target] - 1)  # never after the last step


def test_kinds_can_be_narrowed():
    plan = schedule(settings(kinds=["engine-crash"], rounds=3), [6])
    assert {f.kind for r in plan for f in r} == {"engine-crash"}


def test_percentile_is_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.99) == 99.0


def test_plans_mix_step_and_time_triggers_and_targets():
    plan = parse_plan("engine-crash@step=2,s3-outage@t=1.5,sandbox-crash@step=4:traj-1")
    assert [(p.fault, p.step, p.t, p.target) for p in plan] == [
        ("engine-crash", 2, None, None),
        ("s3-outage", None, 1.5, None),
        ("sandbox-crash", 4, None, "traj-1"),
    ]
    with pytest.raises(ChaosError):
        parse_plan("engine-crash@step=0")
    with pytest.raises(ChaosError):
        random_plan(0, 1, 5)
    assert random_plan(1.0, 7, 9) == random_plan(1.0, 7, 9)


def test_a_training_fault_can_wait_for_a_first_generation_of_a_task_the_policy_acts_in(tmp_path):
    """`FAULT@first-generation=K`: during iteration K, at a trajectory of a task the policy
    acts in (not a trace task) that has taken no action yet; otherwise at one past its first."""
    (planned,) = parse_plan("engine-crash@first-generation=1")
    assert (planned.first_generation, planned.iteration, planned.step) == (1, None, None)
    both = tmp_path / "both.yaml"
    both.write_text("faults:\n  - {fault: engine-crash, iteration: 0, first_generation: 0}\n")
    with pytest.raises(ChaosError, match="exactly one of"):
        parse_plan(str(both))
    policy = frozenset({"learn-sum"})
    at = lambda task, step: SimpleNamespace(task=task, step=step)  # noqa: E731
    assert aimed_at(planned, at("learn-sum", 0), policy)
    assert not aimed_at(planned, at("learn-sum", 1), policy)  # past its first generation
    assert not aimed_at(planned, at("trace-pass", 0), policy)  # scripted: no policy generates there
    (later,) = parse_plan("engine-crash@iteration=1")
    assert [aimed_at(later, at("trace-pass", step), policy) for step in (0, 1)] == [False, True]


def test_an_iterations_faults_wait_until_its_first_generations_are_over():
    """A first-generation fault due in an iteration holds the iteration's other faults back
    until a trajectory of a task the policy acts in is seen past its first generation (or
    ending there): fired first, another fault's recovery outlasted the window and the
    first-generation fault was missed in the run's last iteration."""
    from belayer.chaos.training import FirstGenerationWindows

    policy = frozenset({"learn-sum"})
    at = lambda task, step, status="running": SimpleNamespace(task=task, step=step, status=status)  # noqa: E731
    windows = FirstGenerationWindows()
    windows.observe(1, [("trace-m0", at("trace-pass", 2))], policy)
    assert not windows.past(1)  # only the scripted task has moved on
    windows.observe(1, [("learn-m0", at("learn-sum", 0)), ("learn-m1", at("learn-sum", 0))], policy)
    assert not windows.past(1)
    windows.observe(1, [("learn-m1", at("learn-sum", 0))], policy)
    assert windows.past(1)  # learn-m0 was seen at its first generation and is gone
    later = FirstGenerationWindows()
    later.observe(2, [("learn-m0", at("learn-sum", 1))], policy)
    assert later.past(2) and not later.past(3)
    ended = FirstGenerationWindows()
    ended.observe(0, [("learn-m0", at("learn-sum", 0, "finishing"))], policy)
    assert ended.past(0)


def test_a_run_wide_fault_no_trajectory_offered_strikes_the_train_step(tmp_path):
    """Temporal, its workflow worker and S3 serve the train step as much as a trajectory: a
    fault of theirs that recoveries before it pushed past the last rollouts fires during the
    train step instead of being missed; a fault aimed at a sandbox or an engine does not."""
    from belayer.chaos.training import TrainingChaos
    from belayer.config import BelayerConfig

    chaos = TrainingChaos(BelayerConfig(state_dir=tmp_path), None, "train-x", [])
    training = SimpleNamespace(iteration=3, phase="train")
    rolling = SimpleNamespace(iteration=3, phase="rollout")
    for kind in ("temporal-worker-crash", "temporal-restart", "s3-outage"):
        (planned,) = parse_plan(f"{kind}@iteration=2")
        assert chaos._target(planned, training, []) == ("the train step", None)
        assert chaos._target(planned, rolling, []) is None  # the rollouts may still offer one
    for kind in ("sandbox-crash", "node-crash", "engine-crash"):
        (planned,) = parse_plan(f"{kind}@iteration=2")
        assert chaos._target(planned, training, []) is None


def test_every_fault_kind_names_what_recovers_it_in_one_table():
    """`belayer run --chaos`, `train --chaos` and the soak read one table: a kind added to
    any of them without its line would print a KeyError instead of a report."""
    assert set(RECOVERED_BY) == {*TRAINING_FAULT_KINDS, *SOAK_FAULT_KINDS}
