"""The rollout API (`belayer.RolloutClient`, `belayer.Rollout`) on the real Temporal server
and object store, with stand-ins for what it drives (child trajectories that write real
token logs, rollout nodes that record what they were published), so batches, retries,
streaming, version checks and publishing are tested in seconds. On the whole stack (vLLM,
sandboxes): tests/training/test_rollout_api_stack.py."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from pydantic import ValidationError
from temporalio.worker import Worker

from belayer import Rollout, RolloutClient
from belayer.model.build import model_path
from belayer.model.param_names import WeightNamesError
from belayer.rollouts import RolloutError
from belayer.storage.store import open_store
from belayer.storage.weights import load_weights
from belayer.temporal_client import connect
from belayer.workflows.models import TaskQueues
from belayer.workflows.publishing import PublishWorkflow
from belayer.workflows.rollout_models import RolloutQueues, RolloutRequest, RolloutSettings
from belayer.workflows.rollouts import RolloutWorkflow
from belayer.workloads.models import TraceTask, TraceTurn
from tests.stand_ins import StandInNode, StandInSandboxes, StandInTrajectory, TokenLogs, reward_of
from tests.token_logs import Written

TASKS = [TraceTask(id=f"task{i}", turns=[TraceTurn(think_tokens=1, bash="true")]) for i in range(2)]


@pytest.fixture
async def api(temporal_server, seaweedfs, stack_config, storage_config):
    """A `RolloutClient` whose batches run on stand-in trajectories and two stand-in nodes."""
    token = uuid.uuid4().hex[:8]
    temporal = stack_config.temporal.model_copy(update={"workflow_task_queue": f"wf-{token}"})
    config = stack_config.model_copy(update={"temporal": temporal, "storage": storage_config})
    client = await connect(config.temporal)
    store = open_store(storage_config, encrypted=False)
    fakes = TokenLogs(store)
    nodes = [StandInNode(f"node-a-{token}", version=3), StandInNode(f"node-b-{token}", version=3)]
    workers = [
        Worker(client, task_queue=f"wf-{token}", workflows=[RolloutWorkflow, PublishWorkflow, StandInTrajectory],
               activities=[fakes.token_log]),
        *(Worker(client, task_queue=n.queue, activities=n.activities()) for n in nodes),
    ]  # fmt: skip
    runs = [asyncio.create_task(w.run()) for w in workers]
    rollouts = RolloutClient(config, client)
    rollouts.queues = RolloutQueues(
        trajectories=TaskQueues(), workflows=f"wf-{token}", nodes=[n.queue for n in nodes]
    )
    yield rollouts, fakes, nodes, store
    await asyncio.gather(*(w.shutdown() for w in workers))
    await asyncio.gather(*runs, return_exceptions=True)
    store.close()


async def generate(rollouts: RolloutClient, tasks=TASKS, **overrides) -> list[Rollout]:
    # Stand-in members have no sandboxes to fork.
    return await rollouts.generate(tasks, **({"group_size": 3, "seed": 7, "fork": False} | overrides))


def assert_is_what_was_written(rollout: Rollout, written: Written) -> None:
    """The rollout is its token log cut after the 6-token prompt: tokens, loss mask, and the
    engine's logprob and weights version at every model token (0.0 and -1 elsewhere)."""
    assert rollout.prompt_ids == written.tokens[:6]
    assert rollout.completion_ids == written.tokens[6:]
    assert rollout.loss_mask == written.mask[6:] and sum(rollout.loss_mask) == 5 + 4, "model tokens only"
    assert rollout.weights_versions == [-1 if v is None else v for v in written.versions[6:]]
    assert rollout.logprobs == pytest.approx(
        [0.0 if lp is None else lp for lp in written.logprobs[6:]], rel=1e-6
    )


async def test_a_batch_is_every_group_in_order_with_its_tokens_aligned(api):
    rollouts, fakes, _, _ = api
    got = await generate(rollouts)
    assert [(r.task_id, r.member) for r in got] == [(t.id, m) for t in TASKS for m in range(3)]
    for r in got:
        assert r.status in ("completed", "failed_policy") and r.attempts == 1 and r.turns == 2
        assert r.reward == reward_of(fakes.seeds[r.trajectory_id]) and r.rewards == {"reward": r.reward}
        assert_is_what_was_written(r, fakes.written[r.trajectory_id])
    assert len({fakes.seeds[r.trajectory_id] for r in got}) == len(got), "every member its own seed"


async def test_a_batch_never_holds_more_sandboxes_than_its_concurrency(api):
    """A group takes its members' slots before it forks them (a fork is live while its
    member waits) and its set-up sandbox goes before the forks start: two groups of 3
    under a limit of 4 hold 3 sandboxes at most, where both once set up and forked at the
    start (8). A group larger than the limit is not forked: its members wait for slots."""
    rollouts, _, _, store = api
    queue = f"sandboxes-{uuid.uuid4().hex[:8]}"
    sandboxes = StandInSandboxes(queue, store)
    rollouts.queues = rollouts.queues.model_copy(
        update={"trajectories": TaskQueues(sandbox=queue, context=queue)}
    )
    tasks = [
        TraceTask(id=f"setup{i}", setup=["true"], turns=[TraceTurn(think_tokens=1, bash="true")])
        for i in range(2)
    ]
    async with Worker(rollouts.temporal, task_queue=queue, activities=sandboxes.activities()):
        forked = await generate(rollouts, tasks, fork=True, max_concurrency=4)
        assert (len(forked), sandboxes.forked, sandboxes.most) == (6, 6, 3)
        sandboxes.most = 0
        alone = await generate(rollouts, tasks[:1], fork=True, max_concurrency=2)
        assert (len(alone), sandboxes.forked, sandboxes.most) == (3, 6, 2)
    assert not sandboxes.alive, "every sandbox destroyed"


async def test_the_same_seed_gives_the_same_members_the_same_seeds(api):
    rollouts, fakes, _, _ = api
    first, again, other = [await generate(rollouts, seed=s) for s in (7, 7, 8)]
    seeds = [[fakes.seeds[r.trajectory_id] for r in batch] for batch in (first, again, other)]
    assert seeds[0] == seeds[1] != seeds[2]
    assert [r.completion_ids for r in first] == [r.completion_ids for r in again]


async def test_an_infra_failure_is_retried_with_the_same_seed_and_never_a_reward(api):
    rollouts, fakes, _, _ = api
    tasks = [
        TraceTask(id=name, turns=[TraceTurn(think_tokens=1, bash="true")])
        for name in ("infra-once", "infra-always")
    ]
    once, always = (await generate(rollouts, tasks, group_size=2))[::2]
    assert once.status != "failed_infra" and once.attempts == 2 and once.trajectory_id.endswith("-a1")
    assert fakes.seeds[once.trajectory_id] == digest_seed(once), "the retry keeps the member's seed"
    assert always.status == "failed_infra" and always.attempts == 3 and always.reason == "sandbox host gone"
    assert always.reward is None and always.rewards == {}
    assert always.prompt_ids == always.completion_ids == always.logprobs == always.loss_mask == []


def digest_seed(rollout: Rollout) -> int:
    from belayer.workflows.rollouts import digest

    return digest(7, 0, rollout.task_id, rollout.member) % 2**31


async def test_stream_yields_each_rollout_as_it_ends_and_each_once(api):
    rollouts, _, _, _ = api
    tasks = [TASKS[0], TraceTask(id="held", turns=[TraceTurn(think_tokens=1, bash="true")])]
    streamed = []
    async for rollout in rollouts.stream(tasks, group_size=2, seed=7, fork=False, every_s=0.05):
        streamed.append(rollout)
        if len(streamed) == 2:  # task0's members, while held's still run: let them end
            assert {r.task_id for r in streamed} == {"task0"}
            batch = rollout.trajectory_id.removesuffix(f"-task0-m{rollout.member}-a0")
            for member in range(2):
                await rollouts.temporal.get_workflow_handle(f"{batch}-held-m{member}-a0").signal("release")
    assert sorted((r.task_id, r.member) for r in streamed) == [
        ("held", 0),
        ("held", 1),
        ("task0", 0),
        ("task0", 1),
    ]
    whole = {(r.task_id, r.member): r for r in await generate(rollouts, [TASKS[0]], group_size=2)}
    for r in streamed[:2]:  # the same member, seed and tokens as a whole batch's
        assert r.completion_ids == whole[r.task_id, r.member].completion_ids


async def test_a_batch_on_a_version_the_nodes_do_not_serve_is_refused_naming_both(api):
    rollouts, fakes, _, _ = api
    with pytest.raises(
        RolloutError, match=r"asks for weights v5 but node-a-\w+ serves v3, node-b-\w+ serves v3"
    ):
        await generate(rollouts, weights_version=5)
    assert not fakes.seeds, "nothing ran"
    assert len(await generate(rollouts, weights_version=3)) == 6


def vllm_names(state: dict) -> dict:
    """The state dict as vLLM names it: q, k, v fused into qkv_proj; gate and up into gate_up_proj."""
    out = {}
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            k, v = (state[name.replace("q_proj", p)] for p in ("k_proj", "v_proj"))
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([tensor, k, v])
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [tensor, state[name.replace("gate", "up")]]
            )
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = tensor
    return out


async def test_publish_takes_hf_or_vllm_names_and_every_node_serves_the_version(api):
    rollouts, _, nodes, store = api
    from safetensors.torch import load_file

    built = load_file(
        str(model_path(rollouts.config.rollout.model, rollouts.config.cache_dir) / "model.safetensors")
    )
    state = {name: torch.randn_like(t) for name, t in built.items()}
    results = await rollouts.publish(state, version=4)
    assert sorted(r.node_id for r in results) == sorted(rollouts.queues.nodes)
    assert [n.version for n in nodes] == [4, 4]

    rollouts.init_weight_transfer_engine()
    rollouts.start_weight_update(version=5)
    fused = list(vllm_names(state).items())
    rollouts.update_weights(fused[: len(fused) // 2])
    rollouts.update_weights(dict(fused[len(fused) // 2 :]))
    await rollouts.finish_weight_update()
    assert [n.version for n in nodes] == [5, 5]
    for node in nodes:
        assert [a.version for a in node.published] == [4, 5]
        for args in node.published:
            served = load_weights(store, args.weights)
            assert served.keys() == state.keys() and all(torch.equal(served[k], state[k]) for k in state)


async def test_weights_that_do_not_fit_the_model_are_refused_before_anything_is_published(api):
    rollouts, _, nodes, _ = api
    from safetensors.torch import load_file

    built = load_file(
        str(model_path(rollouts.config.rollout.model, rollouts.config.cache_dir) / "model.safetensors")
    )
    state = dict(built)
    del state["lm_head.weight"]
    state["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(
        WeightNamesError,
        match=r"missing 1: lm_head.weight; not parameters of the model 1: model.extra.weight",
    ):
        await rollouts.publish(state, version=4)
    with pytest.raises(RolloutError, match="before start_weight_update"):
        rollouts.update_weights({})
    assert not any(n.published for n in nodes)


def test_a_batch_refuses_a_task_twice_since_its_group_is_named_after_it():
    with pytest.raises(
        ValidationError, match=r"task ids repeat \(task0\); give each task of a batch its own id"
    ):
        RolloutRequest(batch_id="b", tasks=[TASKS[0], TASKS[1], TASKS[0]],
                       settings=RolloutSettings(group_size=2), queues=RolloutQueues(nodes=["n"]))  # fmt: skip
