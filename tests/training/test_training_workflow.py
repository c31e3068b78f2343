"""`TrainingWorkflow`'s own logic on the real Temporal server and object store, with
stand-ins for what it drives (child trajectories, trainer, nodes), so group handling,
retries, drops, versions and continue-as-new are tested in seconds. The real loop (vLLM,
sandboxes, torch) is in test_training_loop.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.worker import Worker

from belayer.activities.batches import BatchActivities
from belayer.activities.runtime import implements
from belayer.activities.training_log import TrainingLogActivities, read_iterations
from belayer.bench.history import (
    TEMPORAL_HISTORY_LIMIT,
    TEMPORAL_PAYLOAD_LIMIT,
    event_payloads,
    history_proto,
)
from belayer.cli.train import iteration_line, run_report
from belayer.contracts import batches
from belayer.contracts.trainer import (
    START_WEIGHTS,
    TRAIN_STEP,
    StartWeightsArgs,
    TrainerCheckpointRef,
    TrainStepArgs,
    TrainStepResult,
)
from belayer.storage.store import ObjectRef, open_store
from belayer.temporal_client import connect
from belayer.trainer.algorithms import grpo
from belayer.trainer.batch import load_samples
from belayer.trainer.rollout import read_rollout
from belayer.trainer.samples import load_sample
from belayer.training import tasks_by_reference
from belayer.workflows import rollouts
from belayer.workflows.models import TaskQueues
from belayer.workflows.rollouts import NestedGroupWorkflow
from belayer.workflows.training import TrainingWorkflow
from belayer.workflows.training_models import IterationRecord, TrainingInput, TrainingQueues, TrainingResult
from belayer.workloads.models import TraceTask, TraceTurn
from tests.stand_ins import StandInNode, StandInTrajectory, TokenLogs

TASKS = [TraceTask(id=f"task{i}", turns=[TraceTurn(think_tokens=1, bash="true")]) for i in range(4)]


@dataclass
class StandInTrainer:
    """A trainer that records what it was asked, its samples read back from the store."""

    store: object
    steps: list[TrainStepArgs] = field(default_factory=list)
    batches: list[list] = field(default_factory=list)
    starts: list[StartWeightsArgs] = field(default_factory=list)
    stored: list[ObjectRef] = field(default_factory=list)

    @implements(START_WEIGHTS)
    async def start_weights(self, args: StartWeightsArgs) -> ObjectRef:
        self.starts.append(args)
        ref = ObjectRef(
            key=f"w/{args.version}", size=1, sha256=hashlib.sha256(args.model.encode()).hexdigest()
        )
        self.stored.append(ref)
        return ref

    @implements(TRAIN_STEP)
    async def train_step(self, args: TrainStepArgs) -> TrainStepResult:
        self.batches.append(args.batch)
        args = args.model_copy(update={"samples": [*args.samples, *load_samples(self.store, args.batch)]})
        self.steps.append(args)
        sha = hashlib.sha256(f"{args.iteration}".encode()).hexdigest()
        checkpoint = TrainerCheckpointRef(
            iteration=args.iteration,
            key=f"ck/{args.iteration}",
            sha256=sha,
            weights=ObjectRef(key=f"w/{args.weights_version}", size=1, sha256=sha),
            weights_version=args.weights_version,
        )
        return TrainStepResult(
            checkpoint=checkpoint,
            weights_sha256=sha,
            loss=0.0,
            kl=0.0,
            clip_fraction=0.0,
            trained_tokens=len(args.samples),
            samples=len(args.samples),
            resumed_from="memory",
            train_s=0.0,
        )


@dataclass
class StandIns:
    """The trainer and the node a run drives, and what they were asked."""

    trainer: StandInTrainer
    node: StandInNode
    logs: TokenLogs

    @property
    def steps(self) -> list[TrainStepArgs]:
        return self.trainer.steps

    @property
    def published(self) -> list[int]:
        return [args.version for args in self.node.published]

    @property
    def start_models(self) -> list[str | None]:
        return [args.model for args in self.node.published]

    @property
    def published_weights(self) -> list[ObjectRef | None]:
        return [args.weights for args in self.node.published]


@pytest.fixture
async def harness(temporal_server, seaweedfs, stack_config, storage_config):
    token = uuid.uuid4().hex[:8]
    queues = TrainingQueues(
        trajectories=TaskQueues(),
        workflows=f"wf-{token}",
        trainer=f"trainer-{token}",
        nodes=[f"node-{token}"],
    )
    client = await connect(stack_config.temporal)
    store = open_store(storage_config, encrypted=False)
    fakes = StandIns(StandInTrainer(store), StandInNode(queues.nodes[0]), TokenLogs(store))
    workers = [
        Worker(
            client,
            task_queue=queues.workflows,
            workflows=[TrainingWorkflow, NestedGroupWorkflow, StandInTrajectory],
            activities=[
                *TrainingLogActivities(store).all(),
                *BatchActivities(store).all(),
                fakes.logs.token_log,
            ],
        ),
        Worker(
            client,
            task_queue=queues.trainer,
            activities=[fakes.trainer.train_step, fakes.trainer.start_weights],
        ),
        Worker(client, task_queue=queues.nodes[0], activities=fakes.node.activities()),
    ]
    runs = [asyncio.create_task(w.run()) for w in workers]

    async def train(tasks=TASKS, inline=False, **overrides) -> tuple[TrainingResult, list[IterationRecord]]:
        """A run to its end; its tasks stored, as `start_training` stores them (`inline`:
        in the input, as a run from before task sets was started)."""
        values = (
            dict(
                run_id=f"run-{uuid.uuid4().hex[:8]}",
                tasks=tasks,
                model="tiny",
                iterations=2,
                group_size=3,
                tasks_per_iteration=2,
                seed=7,
                queues=queues,
                fork_groups=False,
            )
            | overrides
        )  # stand-in members: no sandboxes to fork
        input = TrainingInput(**values)
        result = await client.execute_workflow(
            "TrainingWorkflow",
            input if inline else tasks_by_reference(store, input),
            id=values["run_id"],
            task_queue=queues.workflows,
            result_type=TrainingResult,
        )
        records = (
            [IterationRecord.model_validate(r) for r in read_iterations(store, result.log)]
            if result.log
            else []
        )
        return result, records

    yield fakes, train
    await asyncio.gather(*(w.shutdown() for w in workers))
    await asyncio.gather(*runs, return_exceptions=True)
    store.close()


async def test_iterations_train_on_group_advantages_and_publish_each_version(harness):
    fakes, train = harness
    result, records = await train(iterations=3)
    assert result.status == "completed" and result.iterations_done == 3
    assert [r.iteration for r in records] == [0, 1, 2]
    assert fakes.published == [2, 3, 4, 5], "the start model as v2, then each iteration's weights"
    # the start is the trainer's own bytes (the nodes check their sha256), never the nodes' own build
    assert fakes.start_models == [None] * 4 and fakes.published_weights[0] == fakes.trainer.stored[0]
    assert [(a.model, a.version) for a in fakes.trainer.starts] == [("tiny", 2)]
    assert [s.sampled_version for s in fakes.steps] == [2, 3, 4]
    assert result.final_weights_sha256 == records[-1].weights_sha256
    for step, record in zip(fakes.steps, records, strict=True):
        assert len(step.samples) == 2 * 3
        assert {s.group for s in step.samples} == set(record.tasks)
        for group in record.tasks:
            members = [s for s in step.samples if s.group == group]
            rewards = record.rewards[record.tasks.index(group)]
            assert [s.advantage for s in members] == pytest.approx(grpo.advantages(rewards))
            assert abs(sum(s.advantage for s in members)) < 1e-6
    assert records[0].mean_reward == pytest.approx(sum(r for group in records[0].rewards for r in group) / 6)


async def test_uniform_groups_are_counted_and_left_out_only_when_asked(harness):
    """A group whose members all scored the same has no advantage: each iteration counts
    them; `skip_uniform_groups` (DAPO's dynamic sampling) also leaves them out of the step."""
    fakes, train = harness
    _, kept = await train(iterations=3, seed=5, run_id="uniform-kept")
    uniform = [[t for t, r in zip(rec.tasks, rec.rewards, strict=True) if len(set(r)) == 1] for rec in kept]
    assert any(uniform) and not all(len(u) == len(r.tasks) for u, r in zip(uniform, kept, strict=True)), (
        "this seed needs both kinds of group: pick another"
    )
    assert [r.uniform_groups for r in kept] == [len(u) for u in uniform]
    assert all(len(step.samples) == 2 * 3 for step in fakes.steps)

    fakes.trainer.steps.clear()
    _, skipped = await train(iterations=3, seed=5, run_id="uniform-skipped", skip_uniform_groups=True)

    def seen(records):
        return [(r.tasks, r.rewards, r.uniform_groups, r.mean_reward) for r in records]

    assert seen(skipped) == seen(kept), "the same rollouts, rewards and curve"
    for step, record, left_out in zip(fakes.steps, skipped, uniform, strict=True):
        assert {s.group for s in step.samples} == set(record.tasks) - set(left_out)
        assert sorted(d.group for d in record.dropped) == sorted(left_out) and record.groups_dropped == len(
            left_out
        )
        assert all("no advantage (skip_uniform_groups)" in d.reason for d in record.dropped)


async def test_the_same_seed_picks_the_same_tasks_and_seeds(harness):
    fakes, train = harness
    _, first = await train(seed=11, run_id="same-a")
    _, second = await train(seed=11, run_id="same-b")
    _, inline = await train(seed=11, run_id="same-inline", inline=True)
    _, other = await train(seed=12, run_id="other")
    assert [(r.tasks, r.rewards) for r in first] == [(r.tasks, r.rewards) for r in second]
    assert [(r.tasks, r.rewards) for r in first] == [(r.tasks, r.rewards) for r in inline], (
        "a stored task set draws as the same tasks inline do"
    )
    assert [(r.tasks, r.rewards) for r in first] != [(r.tasks, r.rewards) for r in other]


async def test_the_trainer_reads_each_sample_as_the_rollout_the_api_gives(harness):
    """One data model: each sample carries its member by reference, and the trainer's
    arrays are that member's `Rollout` (what `RolloutClient` hands a trainer of yours),
    which is its token log as written."""
    fakes, train = harness
    _, records = await train(iterations=1)
    rewards = {(task, member): reward for task, group in zip(records[0].tasks, records[0].rewards, strict=True)
               for member, reward in enumerate(group)}  # fmt: skip
    (step,) = fakes.steps
    for sample in step.samples:
        loaded = load_sample(fakes.trainer.store, sample)
        rollout, written = loaded.rollout, fakes.logs.written[sample.trajectory_id]
        assert rollout == read_rollout(fakes.trainer.store, sample.rollout)
        assert (rollout.task_id, rollout.trajectory_id) == (sample.group, sample.trajectory_id)
        assert rollout.reward == rewards[(rollout.task_id, rollout.member)]
        assert rollout.prompt_ids + rollout.completion_ids == loaded.tokens == written.tokens
        assert loaded.mask == written.mask and loaded.versions == written.versions
        assert [lp is None for lp in loaded.engine_logprobs] == [lp is None for lp in written.logprobs]
        assert [lp for lp in loaded.engine_logprobs if lp is not None] == pytest.approx(
            [lp for lp in written.logprobs if lp is not None], rel=1e-6
        )


async def test_the_train_step_gets_its_samples_by_reference_in_parts(harness, monkeypatch):
    """No payload grows with the batch: the samples go to the store in parts of
    SAMPLES_PER_PART, and the step carries only the parts' references."""
    monkeypatch.setattr(batches, "SAMPLES_PER_PART", 4)  # read by the workflow worker, in this process
    fakes, train = harness
    result, records = await train(iterations=1, tasks_per_iteration=3)
    assert result.status == "completed"
    (refs,) = fakes.trainer.batches
    assert [ref.count for ref in refs] == [4, 4, 1], "9 samples in parts of 4"
    assert all(ref.key.startswith(f"runs/{result.run_id}/batches/iteration-000000/") for ref in refs)
    (step,) = fakes.steps
    assert len(step.samples) == 9 and {s.group for s in step.samples} == set(records[0].tasks)


async def test_an_infra_failure_is_retried_and_never_a_reward(harness):
    fakes, train = harness
    tasks = [TraceTask(id="infra-once", turns=[TraceTurn(think_tokens=1, bash="true")]), *TASKS[:1]]
    result, records = await train(tasks=tasks, iterations=1, tasks_per_iteration=2)
    assert result.status == "completed"
    (record,) = records
    assert record.infra_retries == 3, "each of the 3 members of infra-once ran twice"
    assert record.groups_dropped == 0 and record.groups_kept == 2
    assert all(r is not None for group in record.rewards for r in group)
    samples = fakes.steps[-1].samples
    assert {s.trajectory_id.rsplit("-a", 1)[1] for s in samples if s.group == "infra-once"} == {"1"}


async def test_a_group_still_incomplete_after_its_retries_is_dropped_whole(harness):
    fakes, train = harness
    tasks = [TraceTask(id="infra-always", turns=[TraceTurn(think_tokens=1, bash="true")]), *TASKS[:1]]
    result, records = await train(tasks=tasks, iterations=1, tasks_per_iteration=2, max_infra_retries=1)
    (record,) = records
    assert record.groups_dropped == 1 and record.groups_kept == 1
    assert record.dropped[0].group == "infra-always" and "sandbox host gone" in record.dropped[0].reason
    assert record.infra_retries == 3
    assert {s.group for s in fakes.steps[-1].samples} == {TASKS[0].id}, (
        "no member of the dropped group is trained on"
    )
    assert record.mean_reward == pytest.approx(sum(record.rewards[record.tasks.index(TASKS[0].id)]) / 3)


async def test_each_iteration_counts_the_actions_its_trajectories_ran(harness):
    """`mean_actions_per_trajectory` (per iteration and for the run, in `--json`) counts
    the trajectories that did not fail on infrastructure: a dropped group's are none."""
    _, train = harness
    tasks = [
        TraceTask(id=name, turns=[TraceTurn(think_tokens=1, bash="true")])
        for name in ("actions-5", "infra-always")
    ]
    result, records = await train(tasks=[*tasks, TASKS[0]], tasks_per_iteration=3, max_infra_retries=1)
    for record in records:
        assert dict(zip(record.tasks, record.actions, strict=True)) == {
            "actions-5": [5, 5, 5], "infra-always": [None, None, None], TASKS[0].id: [2, 2, 2]
        }  # fmt: skip
    report = run_report(result, records)
    assert [i["mean_actions_per_trajectory"] for i in report["iterations"]] == [3.5, 3.5]
    assert report["mean_actions_per_trajectory"] == 3.5
    assert "; 3.5 actions per trajectory;" in iteration_line(records[0])


async def test_nodes_serving_another_runs_weights_get_the_start_model_back_first(harness):
    fakes, train = harness
    fakes.node.version = 5
    result, _ = await train(iterations=1, model="tiny-warm")
    assert fakes.published == [6, 7], "the start model as v6, then iteration 0's weights as v7"
    assert [(a.model, a.version) for a in fakes.trainer.starts] == [("tiny-warm", 6)]
    assert fakes.published_weights[0] == fakes.trainer.stored[0] and fakes.steps[0].model == "tiny-warm"
    assert fakes.steps[0].sampled_version == 6 and fakes.steps[0].base is None


async def test_a_failed_publish_is_retried(harness):
    fakes, train = harness
    fakes.node.fail_publish_once = True
    result, _ = await train(iterations=1)
    assert result.status == "completed" and fakes.published == [2, 3]


async def test_continue_as_new_carries_the_run(harness):
    fakes, train = harness
    result, records = await train(iterations=5, continue_as_new_every=2)
    assert result.iterations_done == 5 and [r.iteration for r in records] == list(range(5))
    assert [s.base.iteration if s.base else None for s in fakes.steps] == [None, 0, 1, 2, 3]
    assert fakes.published == [2, 3, 4, 5, 6, 7]


async def test_a_runs_history_replays_without_nondeterminism(harness, stack_config):
    """The workflow code makes the same decisions when replayed (what a restarted worker
    does): a run with a retry, a drop and a continue-as-new, each of its histories."""
    from temporalio.worker import Replayer

    from belayer.temporal_client import data_converter

    fakes, train = harness
    tasks = [TraceTask(id="infra-once", turns=[TraceTurn(think_tokens=1, bash="true")]), *TASKS[:2]]
    result, _ = await train(tasks=tasks, iterations=3, tasks_per_iteration=3, continue_as_new_every=2)
    client = await connect(stack_config.temporal)
    last = await client.get_workflow_handle(result.run_id).fetch_history()
    previous = last.events[0].workflow_execution_started_event_attributes.continued_execution_run_id
    assert previous, "continue-as-new after two iterations"
    histories = [await client.get_workflow_handle(result.run_id, run_id=previous).fetch_history(), last]
    replayer = Replayer(workflows=[TrainingWorkflow], data_converter=data_converter(stack_config.temporal))
    for history in histories:
        await replayer.replay_workflow(history)


async def test_an_iteration_of_many_samples_stays_within_temporals_limits(harness, stack_config):
    """Task sets and samples travel by reference, so neither the dataset's size nor the
    batch's makes a payload grow past Temporal's 2 MB or a history past its 50 MB. `make
    test` runs one group more than an iteration holds unnested (264 samples, nested, from
    5,000 tasks); the figures in the README come from BELAYER_SCALE_SAMPLES=10000
    BELAYER_SCALE_TASKS=100000 (stand-in trajectories, which write real token logs, and a
    stand-in trainer that reads the batch back)."""
    samples = int(os.environ.get("BELAYER_SCALE_SAMPLES", rollouts.NEST_ABOVE + 8))
    dataset = int(os.environ.get("BELAYER_SCALE_TASKS", "5000"))
    fakes, train = harness
    tasks = [TraceTask(id=f"task{i}", turns=[TraceTurn(think_tokens=1, bash="true")]) for i in range(dataset)]
    started = time.monotonic()
    result, records = await train(tasks=tasks, iterations=1, group_size=8, tasks_per_iteration=samples // 8,
                                  concurrency=min(1024, samples))  # fmt: skip
    wall_s = time.monotonic() - started
    assert result.status == "completed" and records[0].groups_kept == samples // 8
    (refs,) = fakes.trainer.batches
    assert sum(ref.count for ref in refs) == samples == len(fakes.steps[0].samples)
    assert all(ref.count <= batches.SAMPLES_PER_PART for ref in refs)

    client = await connect(stack_config.temporal)
    history = await client.get_workflow_handle(result.run_id).fetch_history()
    sizes = [
        (len(p.SerializeToString()), event.event_type)
        for event in history.events
        for p in event_payloads(event)
    ]
    (largest, kind), input_bytes = max(sizes), sizes[0][0]
    history_bytes = history_proto(history).ByteSize()
    print(json.dumps({"samples": samples, "tasks": dataset, "events": len(history.events),
                      "history_bytes": history_bytes, "largest_payload_bytes": largest,
                      "largest_payload_event": EventType.Name(kind), "input_bytes": input_bytes,
                      "batch_parts": len(refs), "wall_s": round(wall_s, 1)}))  # fmt: skip
    assert input_bytes < 8192, "the run's input holds a pointer to its tasks, not the tasks"
    assert largest < TEMPORAL_PAYLOAD_LIMIT / 4 and history_bytes < TEMPORAL_HISTORY_LIMIT / 4


async def test_nested_groups_give_what_direct_children_give(harness, stack_config, monkeypatch):
    """Above NEST_ABOVE members an iteration runs each group as a workflow of its own: the
    same trajectory ids, seeds, rewards, retries and drops as when they are direct children."""
    trace = [TraceTurn(think_tokens=1, bash="true")]
    tasks = [TraceTask(id="infra-once", turns=trace), TraceTask(id="infra-always", turns=trace), *TASKS]
    fakes, train = harness

    def trained(steps, run_id):
        return [[(s.trajectory_id.removeprefix(run_id), s.advantage) for s in step.samples] for step in steps]

    direct_id, nested_id = f"direct-{uuid.uuid4().hex[:6]}", f"nested-{uuid.uuid4().hex[:6]}"
    _, direct = await train(tasks=tasks, tasks_per_iteration=6, seed=3, run_id=direct_id)
    direct_steps = list(fakes.steps)
    monkeypatch.setattr(rollouts, "NEST_ABOVE", 0)  # read by the workflow worker, in this process
    _, nested = await train(tasks=tasks, tasks_per_iteration=6, seed=3, run_id=nested_id)
    summary = [(r.tasks, r.rewards, r.infra_retries, r.groups_dropped) for r in nested]
    assert summary == [(r.tasks, r.rewards, r.infra_retries, r.groups_dropped) for r in direct]
    assert all(r.groups_dropped == 1 and r.infra_retries > 0 for r in nested), (
        "infra-always dropped, infra-once retried"
    )
    assert trained(fakes.steps[len(direct_steps) :], nested_id) == trained(direct_steps, direct_id)

    client = await connect(stack_config.temporal)
    history = await client.get_workflow_handle(nested_id).fetch_history()
    started = [
        e.start_child_workflow_execution_initiated_event_attributes.workflow_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    ]
    assert started.count("NestedGroupWorkflow") == 2 * 6 and "TrajectoryWorkflow" not in started
