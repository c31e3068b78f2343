"""`AgentSessionWorkflow`: a trajectory whose agent owns its loop.

An agent written against an OpenAI client (a harness of its own, beside the sandbox)
drives it through `belayer serve` (belayer/serve/): each model call and each command is
one call of this workflow's `call` update, answered in the order they came. Everything
else is `TrajectoryWorkflow`'s: the sandbox is created, checkpointed by the policy after
actions, restored with replay-verify when lost, judged by the task's own check, and the
result is the same `TrajectoryResult`, so the rollout it makes is the same `Rollout`.

What differs, and why:
- the context is what the client renders. The token log starts empty; each generate call
  brings the client's whole prompt (by pointer), which either extends what is logged
  (the new tokens are appended, marked "env") or does not (the client rewrote its
  history): a new log is forked from the longest common prefix, recorded as a cut
  (`SessionCut`), never a silent mismatch;
- observations are the client's to put in its next prompt: an action records its step
  (command, observation) for replay-verify, and appends nothing;
- the client cannot be cut back: a restore whose replay finds the sandbox answering an
  earlier step differently ends the session failed_infra, where a model-driven
  trajectory would cut its own context (no reward comes from a sandbox that disagrees
  with what the agent saw);
- the update id is the client's request id: a retried call is answered with the outcome
  of the first, the same tokens, never a second generation.

Workflow code only: no I/O, clocks or randomness outside Temporal's APIs.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from belayer.contracts import sandbox
    from belayer.contracts.context import (
        EXTEND_CONTEXT,
        START_CONTEXT,
        AppendObservationArgs,
        ContextResult,
        ExtendContextArgs,
        StartContextArgs,
    )
    from belayer.contracts.errors import BAD_REQUEST
    from belayer.contracts.generate import GenerateArgs, SamplingParams
    from belayer.contracts.sandbox import Action, ExecArgs
    from belayer.workflows.models import ForkStart, StepRecord, TrajectoryInput, TrajectoryResult
    from belayer.workflows.session_models import (
        ExecCall,
        ExecReply,
        FinishCall,
        FinishReply,
        GenerateCall,
        GenerateReply,
        SessionCall,
        SessionCut,
        SessionView,
    )
    from belayer.workflows.trajectory import InfraFailure, TrajectoryWorkflow, first_line

# A session nobody calls for this long is finished as if its client had asked: the check
# runs and the sandbox goes (the client died or forgot; nothing is left running).
IDLE_LIMIT = timedelta(minutes=30)
SESSION_ENDED = "BelayerSessionEnded"


class CallRefused(Exception):
    """A call the session cannot take as it stands (the client's mistake): the call fails
    with this message, the session goes on."""


@workflow.defn(name="AgentSessionWorkflow")
class AgentSessionWorkflow(TrajectoryWorkflow):
    @workflow.init
    def __init__(self, input: TrajectoryInput) -> None:
        super().__init__(input)
        self.calls: list[tuple[SessionCall, asyncio.Future]] = []
        self.accepting = True
        self.cuts: list[SessionCut] = []
        self.generate_calls = 0
        self.creating: asyncio.Task | None = None  # the sandbox, created beside the first calls

    @workflow.run
    async def run(self, input: TrajectoryInput) -> TrajectoryResult:
        try:
            return await super().run(input)
        finally:
            self._refuse_waiting("the session ended")

    # ---------------------------------------------------------------- the client's side

    @workflow.query(name="session")
    def session(self) -> SessionView:
        state = self.state
        return SessionView(
            trajectory_id=self.input.trajectory_id,
            task=self.input.task.id,
            status=self.status,
            accepting=self.accepting,
            step=state.step,
            turn_limit=self._driver.turn_limit(self.input.task),
            generations=state.generations,
            context=state.context,
            cuts=self.cuts,
        )

    @workflow.update(name="call")
    async def call(
        self, call: GenerateCall | ExecCall | FinishCall
    ) -> GenerateReply | ExecReply | FinishReply:
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        self.calls.append((call, reply))
        return await reply

    @call.validator
    def _accept(self, call: GenerateCall | ExecCall | FinishCall) -> None:
        if not self.accepting:
            raise ApplicationError(
                f"session {self.input.trajectory_id} is finished ({self.status}): start a new session",
                type=SESSION_ENDED,
                non_retryable=True,
            )

    # ---------------------------------------------------------------- the loop

    async def _start_sandbox(self, start: ForkStart | None) -> None:
        """A new sandbox is created beside the session's first calls, not before them: a
        model call needs only the token log, and a task's setup can take minutes. What
        needs the sandbox (an action, the check, the end) waits for it (`_sandbox_ready`)."""
        if start is not None and start.sandbox is not None:
            return await super()._start_sandbox(start)
        self.creating = asyncio.ensure_future(super()._start_sandbox(start))

    async def _sandbox_ready(self) -> None:
        """Once the sandbox is created; `InfraFailure` when it could not be."""
        if self.creating is not None:
            await self.creating

    async def _destroy(self) -> None:
        if self.creating is not None:
            await asyncio.gather(self.creating, return_exceptions=True)  # never leave one being created
        await super()._destroy()

    async def _open_context(self, start: ForkStart | None) -> ContextResult:
        """An empty token log, a group member's too (its sandbox is the group's fork): the
        client renders the prompt. A branch (`Sessions.branch`) forks its parent's log
        instead, as any branch does (`_start_branch`)."""
        return await self._context_activity(
            START_CONTEXT,
            StartContextArgs(log_key=self._log_key(), trajectory_id=self.input.trajectory_id,
                             steps_key=self._steps_key(), instruction=None),
            summary="an empty token log: the client sends the prompt",
        )  # fmt: skip

    def _should_continue_as_new(self) -> bool:
        return False  # an update in flight cannot follow a new run; a session is bounded by its task

    async def _turns_then_finish(self) -> TrajectoryResult:
        """Answer calls in order until the client finishes (or goes quiet), then judge."""
        while True:
            if not await self._next_call():
                break
            call, reply = self.calls.pop(0)
            if isinstance(call, FinishCall):
                reply.set_result(FinishReply(step=self.state.step))
                break
            try:
                reply.set_result(await self._answer(call))
            except CallRefused as refused:
                reply.set_exception(ApplicationError(str(refused), type=BAD_REQUEST, non_retryable=True))
            except BaseException as ended:
                reply.set_exception(_ended(f"the session ended during this call: {ended}"))
                raise
        self._refuse_waiting("the session is finishing: its check runs now")
        await self._sandbox_ready()
        await self._settle_checkpoint()
        return await self._finish()

    async def _next_call(self) -> bool:
        try:
            await workflow.wait_condition(lambda: bool(self.calls), timeout=IDLE_LIMIT)
        except TimeoutError:
            return False
        return True

    def _refuse_waiting(self, why: str) -> None:
        self.accepting = False
        waiting, self.calls = self.calls, []
        for _, reply in waiting:
            if not reply.done():
                reply.set_exception(_ended(why))

    async def _answer(self, call: GenerateCall | ExecCall) -> GenerateReply | ExecReply:
        if isinstance(call, GenerateCall):
            return await self._generate_call(call)
        return await self._exec_call(call)

    async def _generate_call(self, call: GenerateCall) -> GenerateReply:
        self.generate_calls += 1
        before = self.state.context
        extended = await self._context_activity(
            EXTEND_CONTEXT,
            ExtendContextArgs(
                prefix=before, prompt=call.prompt, fork_to=f"{self._log_key()}-cut{len(self.cuts) + 1}"
            ),
            summary=f"call {self.generate_calls}: the client's prompt ({call.prompt.length} tokens)",
        )
        self.state.context = extended.prefix
        if extended.cut:
            self.cuts.append(
                SessionCut(
                    call=self.generate_calls,
                    kept_tokens=extended.kept_tokens,
                    discarded_tokens=before.length - extended.kept_tokens,
                )
            )
        budget = self.input.max_total_tokens - self.state.context.length
        if budget <= 0:
            raise CallRefused(
                f"the prompt is {self.state.context.length} tokens and the session's context holds "
                f"{self.input.max_total_tokens}: shorten the conversation"
            )
        temperature = self.input.sampling.temperature if call.temperature is None else call.temperature
        seed = self.input.sampling.seed + self.state.generations if call.seed is None else call.seed
        sampling = SamplingParams(max_tokens=min(call.max_tokens, budget), temperature=temperature,
                                  top_p=call.top_p, seed=seed, stop=call.stop, ignore_eos=call.ignore_eos)  # fmt: skip
        result = await self._generate_with_affinity(
            GenerateArgs(prefix=self.state.context, sampling=sampling)
        )
        self.state.context = result.prefix
        self._generated(result)
        return GenerateReply(
            text=result.text,
            finish_reason=result.finish_reason,
            prompt_tokens=extended.prefix.length,
            completion_tokens=result.output_tokens,
            context=result.prefix,
            generation=result.generation,
            context_cut=extended.cut,
            kept_tokens=extended.kept_tokens,
            engine_recoveries=result.engine_recoveries,
            node_queue=result.node_queue,
            timing=result.timing,
        )

    async def _exec_call(self, call: ExecCall) -> ExecReply:
        limit = self._driver.turn_limit(self.input.task)
        if self.state.step >= limit:
            raise CallRefused(f"the task allows {limit} actions and the session ran them: finish the session")
        await self._sandbox_ready()
        await self._wait_for_capture()
        self.state.step += 1
        action = Action(trajectory=self.input.trajectory_id, step=self.state.step, command=call.command,
                        timeout_s=self._driver.action_timeout_s(self.input.task, self.state.stage))  # fmt: skip
        executed = await self._on_sandbox(
            sandbox.EXEC,
            lambda handle: ExecArgs(handle=handle, action=action),
            summary=f"step {action.step}: {first_line(call.command)}",
        )
        record = StepRecord(step=action.step, command=call.command, observation=executed.observation,
                            context_after_action=self.state.context, stage=self.state.stage)  # fmt: skip
        await self._record_step(record)
        return ExecReply(step=action.step, observation=executed.observation)

    async def _append_observation(self, record: StepRecord) -> None:
        """The step goes to the step log (replay-verify reads it); the token log is the client's."""
        self.pending_observation = AppendObservationArgs(
            trajectory_id=self.input.trajectory_id,
            prefix=self.state.context,
            step=record,
            steps_key=self._steps_key(),
            entries=self._unwritten_entries(keep_latest_decision=True),
            append_tokens=False,
        )
        await self._flush_observation()

    def _cut_context(self, at, observation, record):
        """A restore found the sandbox answering step `at.step` differently from what the
        client saw; the client's context cannot be cut back, so the session ends."""
        record.cut_after_step = at.step
        raise InfraFailure(
            f"the sandbox restored after a loss answers step {at.step} ({first_line(at.command)}) "
            "differently from what the client saw; a session cannot rewind its client, so it ends "
            "here (keep more checkpoints with --policy every-step to make this rarer)"
        )


def _ended(why: str) -> ApplicationError:
    return ApplicationError(why, type=SESSION_ENDED, non_retryable=True)
