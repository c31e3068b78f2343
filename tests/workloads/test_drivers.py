"""Task drivers: what each kind answers the trajectory loop, and the registry of kinds."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from belayer.agent_format import malformed_observation, parse_action
from belayer.sandbox.models import ImageSemantics, SandboxSpec, StoredFiles
from belayer.workloads.drivers import (
    GradedCheck,
    HarborDriver,
    ModelDriver,
    TraceDriver,
    TurnSampling,
    Verification,
)
from belayer.workloads.models import ModelTask, Task, TraceTask, TraceTurn
from belayer.workloads.registry import DRIVERS, KINDS, UnknownTaskKind, driver_for, driver_for_kind, task_kind
from belayer.workloads.tasks import HarborTask

TRACE = TraceTask(id="t1", turns=[TraceTurn(think_tokens=5, bash="ls"), TraceTurn(think_tokens=0, bash="pwd")],
                  check="test -f done", verify_with_processes="running")  # fmt: skip
MODEL = ModelTask(id="m1", instruction="create hello.txt", max_turns=3, max_tokens_per_turn=64)
TESTS = StoredFiles(key="harbor/files/t.tar", sha256="a" * 64)
HARBOR = HarborTask(id="h1", instruction="fix the bug", image="localhost/belayer-task/h1:0", tests=TESTS,
                    semantics=ImageSemantics(workdir="/app"), verifier_timeout_s=30, verifier_env={"LEVEL": "it's"},
                    agent_timeout_s=120, max_turns=4)  # fmt: skip


def test_trace_driver_replays_the_recorded_turns_whatever_the_engine_says():
    driver = TraceDriver()
    assert driver.instruction(TRACE) == "replay trace t1"
    assert driver.turn_limit(TRACE) == 2
    assert driver.sampling(TRACE, 0) == TurnSampling(max_tokens=5, ignore_eos=True)
    assert driver.sampling(TRACE, 1) == TurnSampling(max_tokens=0, ignore_eos=True)
    assert driver.next_action(TRACE, 1, "<bash>rm -rf /</bash>") == "pwd"
    assert [driver.expected_output_tokens(TRACE, step) for step in range(3)] == [5, 0, 0]


def test_model_driver_acts_on_what_the_model_generated():
    driver = ModelDriver()
    assert driver.instruction(MODEL) == "create hello.txt"
    assert driver.turn_limit(MODEL) == 3
    assert driver.sampling(MODEL, 2) == TurnSampling(max_tokens=64, ignore_eos=False)
    assert driver.next_action(MODEL, 0, "<bash>touch hello.txt</bash>") == "touch hello.txt"
    assert driver.expected_output_tokens(MODEL, 0) is None


def test_model_driver_stops_when_the_model_calls_no_tool():
    assert ModelDriver().next_action(MODEL, 0, "I am done.") is None


def test_a_malformed_action_becomes_a_harmless_print_of_what_was_wrong():
    generated = "<bash>ls"  # never closed
    action = ModelDriver().next_action(MODEL, 0, generated)
    explanation = malformed_observation(parse_action(generated))
    assert action == "printf '%s\\n' '" + explanation.replace("'", "'\\''") + "'"


def test_verification_is_the_tasks_check_with_its_processes_setting():
    assert TraceDriver().verification(TRACE) == Verification(command="test -f done", processes="running")
    assert ModelDriver().verification(MODEL) is None  # no check: reward 1


def test_an_own_kinds_action_limit_is_its_tasks_or_else_the_sandboxes():
    assert TraceDriver().action_timeout_s(TRACE) is None  # sandbox.action_timeout_s
    assert TraceDriver().action_timeout_s(TRACE.model_copy(update={"action_timeout_s": 600.0})) == 600.0
    assert ModelDriver().action_timeout_s(ModelTask(id="m2", instruction="wait", action_timeout_s=5)) == 5
    with pytest.raises(ValueError, match="action_timeout_s"):
        TraceTask(id="t2", turns=[TraceTurn(think_tokens=1, bash="ls")], action_timeout_s=0)


def test_harbor_driver_runs_the_policy_the_solution_or_nothing():
    driver = HarborDriver()
    oracle, nop = (HARBOR.model_copy(update={"agent": agent}) for agent in ("oracle", "nop"))
    assert [driver.turn_limit(t) for t in (HARBOR, oracle, nop)] == [4, 1, 0]
    assert driver.next_action(HARBOR, 0, "<bash>make</bash>") == "make"
    assert driver.next_action(oracle, 0, "<bash>rm -rf /</bash>") == "bash /solution/solve.sh"
    assert driver.sampling(oracle, 0) == TurnSampling(max_tokens=1, ignore_eos=True)
    assert [driver.expected_output_tokens(oracle, step) for step in (0, 1)] == [1, 0]
    assert driver.action_timeout_s(HARBOR) == 120 and ModelDriver().action_timeout_s(MODEL) is None


def test_harbor_verification_is_its_tests_graded_in_its_workdir_with_its_env():
    verification = HarborDriver().verification(HARBOR)
    assert verification.command == "export LEVEL='it'\\''s'\ncd '/app' && bash /tests/test.sh"
    assert verification.processes == "running"  # Harbor's semantics: the agent's servers keep serving
    assert verification.graded == GradedCheck(tests=TESTS, timeout_s=30, reward_key=None)
    spec = HarborDriver().sandbox(HARBOR)
    assert (spec.image, spec.semantics.workdir) == (HARBOR.image, "/app")
    assert TraceDriver().sandbox(TRACE) == SandboxSpec(setup_commands=[])


def answers(driver, task) -> list:
    return [driver.instruction(task), driver.turn_limit(task), driver.sampling(task, 0),
            driver.next_action(task, 0, "<bash>x</bash>"), driver.expected_output_tokens(task, 0),
            driver.verification(task)]  # fmt: skip


def test_drivers_answer_the_same_on_every_call():
    """Workflow code replays: a driver's answers depend on the task and the step alone."""
    for driver, task in ((TraceDriver(), TRACE), (ModelDriver(), MODEL), (HarborDriver(), HARBOR)):
        assert answers(driver, task) == answers(driver, task.model_copy(deep=True))


def test_the_registry_finds_each_tasks_driver():
    assert isinstance(driver_for(TRACE), TraceDriver)
    assert isinstance(driver_for(MODEL), ModelDriver)
    assert isinstance(driver_for(HARBOR), HarborDriver)
    assert KINDS == tuple(driver.kind for driver in DRIVERS) == ("trace", "model", "harbor")


@pytest.mark.parametrize("kind", ["swe", "", None, ["trace"]])
def test_the_registry_refuses_an_unknown_kind_naming_the_known_ones(kind):
    with pytest.raises(UnknownTaskKind, match=r"unknown task kind .*: use one of trace, model, harbor"):
        driver_for_kind(kind)


def test_a_task_naming_no_kind_is_of_the_kind_its_fields_imply():
    assert task_kind({"id": "a", "turns": []}) == "trace"
    assert task_kind({"id": "a", "instruction": "x"}) == "model"
    assert task_kind({"id": "a", "kind": "trace", "instruction": "x"}) == "trace"
    assert task_kind(MODEL) == "model"


def test_the_task_union_validates_each_kind_into_its_drivers_model():
    adapter = TypeAdapter(Task)
    for driver in DRIVERS:
        task = {"trace": TRACE, "model": MODEL, "harbor": HARBOR}[driver.kind]
        validated = adapter.validate_python(task.model_dump())
        assert type(validated) is driver.model and validated == task
