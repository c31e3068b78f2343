"""Agent sessions (`AgentSessionWorkflow`, `belayer.serve.Sessions`) on the real stack
(Temporal, SeaweedFS, podman + CRIU) with the scripted engine: the client's prompts become
the token log, rewritten ones are cuts, retried calls are answered once, the sandbox is
restored when lost, and the result is the same rollout the rollout API gives. The real
engine and the HTTP endpoint: tests/workflows/test_agent_endpoint.py."""

from __future__ import annotations

import contextlib
import uuid

import pytest

from belayer.agent_format import observation_text, render_chat
from belayer.policy.config import PolicyConfig
from belayer.serve.sessions import SessionError, Sessions
from belayer.storage.tokenlog import read_marks, read_prefix
from belayer.temporal_client import connect
from belayer.workflows.groups import GroupResult
from belayer.workflows.models import TrajectoryProgress
from belayer.workloads.models import TraceTask, TraceTurn
from tests.workflows.conftest import trajectory_stack
from tests.workflows.test_trajectory import wait_for_step

TASK = TraceTask(
    id="marker",
    setup=["mkdir -p /workspace/w"],
    turns=[TraceTurn(think_tokens=1, bash="true") for _ in range(3)],
    check="test -f /workspace/w/done && test $(cat /workspace/w/count) = 2",
)
REPLIES = ["<bash>echo 1 > /workspace/w/count</bash>", "<bash>echo 2 > /workspace/w/count</bash>", "done."]


@contextlib.asynccontextmanager
async def sessions_on(stack_config, storage_config, tokenizer_path, replies=REPLIES):
    async with trajectory_stack(stack_config, storage_config, tokenizer_path, replies=replies) as stack:
        temporal = stack_config.temporal.model_copy(update={"workflow_task_queue": stack.queues.context})
        config = stack_config.model_copy(
            update={
                "storage": storage_config,
                "policy": PolicyConfig(mode="every-step"),
                "temporal": temporal,
            }
        )
        sessions = Sessions(config, await connect(config.temporal, config.storage.encryption_key))
        sessions.queues = stack.queues
        try:
            yield stack, sessions
        finally:
            sessions.close()


def conversation(instruction: str, *exchanges: tuple[str, str]) -> list[dict]:
    messages = [{"role": "user", "content": instruction}]
    for reply, observation in exchanges:
        messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": observation}]
    return messages


async def test_a_session_logs_the_clients_context_and_ends_in_the_same_rollout(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path
):
    async with sessions_on(stack_config, storage_config, tokenizer_path) as (stack, sessions):
        started = await sessions.start(TASK, seed=3)
        sid = started.session_id
        exchanges = []
        for _ in range(2):
            prompt = render_chat(conversation(started.instruction, *exchanges))
            generated = await sessions.generate(
                sid, prompt, request_id=f"turn-{len(exchanges)}", max_tokens=64
            )
            assert not generated.reply.context_cut, "the client sent back what it was given"
            step, observation = await sessions.exec(
                sid, generated.reply.text.removeprefix("<bash>").removesuffix("</bash>")
            )
            assert (step, observation.exit_code) == (len(exchanges) + 1, 0)
            exchanges.append((generated.reply.text, f"[exit {observation.exit_code}]"))
        # A retried call (same request id) is answered with the first call's tokens, not generated again.
        calls_before = stack.rollout.calls
        again = await sessions.generate(sid, "anything at all", request_id="turn-1", max_tokens=64)
        assert again.reply.text == REPLIES[1] and stack.rollout.calls == calls_before
        await sessions.exec(sid, "touch /workspace/w/done")
        view = await sessions.view(sid)
        assert view.step == 3 and view.cuts == [] and view.accepting
        with pytest.raises(SessionError, match="allows 3 actions") as refused:
            await sessions.exec(sid, "true")
        assert refused.value.kind == "bad_request"
        last = render_chat(conversation(started.instruction, *exchanges)) + "\n"
        final = await sessions.generate(sid, last, max_tokens=8)
        result, rollout = await sessions.finish(sid)
        with pytest.raises(SessionError) as ended:
            await sessions.generate(sid, last, max_tokens=8)
        assert ended.value.kind == "ended"

        assert result.status == "completed" and result.reward == 1.0, result.reason
        assert result.turns == 3 and rollout.trajectory_id == sid and rollout.reward == 1.0
        tokens = read_prefix(stack.store, result.context)
        model = [
            tokens[s.start : s.end] for s in read_marks(stack.store, result.context) if s.source == "model"
        ]
        encode = sessions.tokenizer.encode
        assert model == [encode(r, add_special_tokens=False).ids for r in REPLIES]
        assert final.token_ids == model[-1] and final.reply.text == REPLIES[-1]
        # The log is exactly the client's last prompt then the last turn: nothing re-encoded.
        assert sessions.tokenizer.decode(tokens, skip_special_tokens=True) == last + final.reply.text
        assert (
            rollout.prompt_ids
            == encode(render_chat(conversation(started.instruction)), add_special_tokens=False).ids
        )
        assert rollout.prompt_ids + rollout.completion_ids == tokens
        assert sum(rollout.loss_mask) == sum(len(m) for m in model)


async def test_a_rewritten_context_is_a_cut_and_a_lost_sandbox_is_restored(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path
):
    async with sessions_on(stack_config, storage_config, tokenizer_path) as (stack, sessions):
        started = await sessions.start(TASK, session_id=f"cut-{uuid.uuid4().hex[:8]}")
        sid = started.session_id
        first = await sessions.generate(sid, render_chat(conversation(started.instruction)), max_tokens=64)
        await sessions.exec(sid, "echo 1 > /workspace/w/count")
        await sessions.exec(sid, "echo 2 > /workspace/w/count")
        logged = first.reply.context.length
        # The client summarised its history: the prompt no longer starts with what was logged.
        rewritten = render_chat(conversation("Write 2 to /workspace/w/count, then touch /workspace/w/done."))
        cut = await sessions.generate(sid, rewritten, max_tokens=64)
        assert cut.reply.context_cut and cut.reply.kept_tokens < logged
        (recorded,) = (await sessions.view(sid)).cuts
        assert recorded.call == 2 and recorded.discarded_tokens == logged - recorded.kept_tokens

        handle = stack.client.get_workflow_handle(sid)
        progress = await wait_for_step(handle, 2)
        stack.sandboxes.backend.podman("kill", progress.sandbox.container, check=False)
        step, observation = await sessions.exec(sid, "cat /workspace/w/count && touch /workspace/w/done")
        assert (step, observation.stdout.strip()) == (3, "2"), "restored from the checkpoint after step 2"
        result, rollout = await sessions.finish(sid)
    assert result.status == "completed" and result.reward == 1.0, result.reason
    (recovery,) = result.recoveries
    assert recovery.consistent and recovery.source.startswith("checkpoint@")
    assert result.context.key.endswith("-cut1"), "the rollout is the context after the cut"
    assert rollout.prompt_ids + rollout.completion_ids == read_prefix(stack.store, result.context)


async def test_a_group_of_sessions_forks_one_set_up_sandbox(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path
):
    task = TASK.model_copy(
        update={"id": "grouped", "setup": ["mkdir -p /workspace/w", "echo 2 > /workspace/w/seed"]}
    )
    async with sessions_on(stack_config, storage_config, tokenizer_path, replies=[]) as (stack, sessions):
        members = await sessions.start_group(task, 2, seed=5)
        finished = []
        for member, command in zip(members, ["cp /workspace/w/seed /workspace/w/count", "true"], strict=True):
            prompt = render_chat(conversation(member.instruction))
            await sessions.generate(member.session_id, prompt, max_tokens=4)
            step, observation = await sessions.exec(member.session_id, f"cat /workspace/w/seed && {command}")
            assert (step, observation.stdout.strip()) == (1, "2"), (
                "each member's sandbox is the set-up one's fork"
            )
            await sessions.exec(member.session_id, "touch /workspace/w/done")
            finished.append(await sessions.finish(member.session_id))
        group_id = members[0].session_id.rsplit("-m", 1)[0]
        group = await stack.client.get_workflow_handle(group_id, result_type=GroupResult).result()
    assert group.group.forked == 2 and not group.group.fallback
    assert [m.session_id for m in members] == [r.trajectory_id for r in group.results]
    assert [(r.status, r.reward) for r, _ in finished] == [("completed", 1.0), ("failed_policy", 0.0)]
    # Member k samples from seed + k: the two first turns differ.
    first_turns = [rollout.completion_ids[:4] for _, rollout in finished]
    assert first_turns[0] != first_turns[1]


async def test_a_sessions_first_calls_do_not_wait_for_its_sandbox(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path
):
    """The sandbox is created beside the first model calls (a task's setup can take
    minutes); the first action waits for it. The setup here outlasts a scripted call many
    times over, so the call's answer comes while the setup still runs."""
    task = TASK.model_copy(update={"id": "slow-setup", "setup": ["sleep 4", "mkdir -p /workspace/w"]})
    async with sessions_on(stack_config, storage_config, tokenizer_path) as (stack, sessions):
        started = await sessions.start(task)
        await sessions.generate(
            started.session_id, render_chat(conversation(started.instruction)), max_tokens=8
        )
        handle = stack.client.get_workflow_handle(started.session_id)
        assert (await handle.query("progress", result_type=TrajectoryProgress)).sandbox is None
        step, observation = await sessions.exec(started.session_id, "ls -d /workspace/w")
        assert (step, observation.exit_code) == (1, 0), "the action ran in the set-up sandbox"
        result, _ = await sessions.finish(started.session_id)
    assert result.status == "failed_policy" and result.reward == 0.0  # its check wants files it never wrote


async def test_a_branch_of_a_session_goes_on_after_its_step_in_a_restored_sandbox(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path
):
    async with sessions_on(stack_config, storage_config, tokenizer_path) as (stack, sessions):
        parent = await sessions.start(TASK, keep_checkpoints=True)
        first = await sessions.generate(
            parent.session_id, render_chat(conversation(parent.instruction)), max_tokens=64
        )
        _, step1 = await sessions.exec(parent.session_id, "echo 1 > /workspace/w/count")
        await sessions.exec(parent.session_id, "echo 7 > /workspace/w/count")
        await sessions.finish(parent.session_id)

        branched = await sessions.branch(parent.session_id, at_step=1)
        (branch,) = branched.sessions
        exchange = (first.reply.text, observation_text(step1))
        assert branched.context_text == render_chat(conversation(parent.instruction)) + first.reply.text
        view = await sessions.view(branch.session_id)
        parent_context = (first.reply.context.length, first.reply.context.sha256)
        assert view.step == 1 and (view.context.length, view.context.sha256) == parent_context, (
            "as step 1 ran"
        )
        # The client's own history up to step 1, with that step's output as a tool message, extends it.
        second = await sessions.generate(branch.session_id, render_chat(conversation(parent.instruction, exchange)),
                                         max_tokens=64)  # fmt: skip
        assert not second.reply.context_cut and second.reply.kept_tokens == first.reply.context.length
        step, observation = await sessions.exec(branch.session_id, "cat /workspace/w/count")
        assert (step, observation.stdout.strip()) == (2, "1"), (
            "the sandbox as it was after the parent's step 1"
        )
        await sessions.exec(branch.session_id, "echo 2 > /workspace/w/count && touch /workspace/w/done")
        result, rollout = await sessions.finish(branch.session_id)
    assert result.status == "completed" and result.reward == 1.0, result.reason
    assert result.recoveries[0].kind == "fork" and result.recoveries[0].consistent
    assert rollout.prompt_ids + rollout.completion_ids == read_prefix(stack.store, result.context)
