"""Real faults against the rollout batches of a trainer outside Belayer's loop (the
rollout API; `examples/trl_grpo.py --chaos`).

The plan is `belayer train`'s (`FAULT@iteration=K`, `FAULT@t=SECONDS`), an iteration
being one step of the user's trainer: a fault of step K fires once a trajectory of that
step's batch has run an action, and is measured until that trajectory moves on, as in
a training run (belayer/chaos/training.py, whose injector this is). `trainer-crash` has
no target here: the trainer is the user's own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from types import SimpleNamespace

from belayer.chaos.faults import ChaosError
from belayer.chaos.plan import PlannedFault, parse_plan
from belayer.chaos.training import TrainingChaos
from belayer.config import BelayerConfig
from belayer.temporal_client import connect
from belayer.workflows.rollouts import RolloutWorkflow

RUNNING_BATCHES = "WorkflowType = 'RolloutWorkflow' AND ExecutionStatus = 'Running'"


class RolloutChaos(TrainingChaos):
    """Injects `plan` into the stack's running rollout batches; `step_of()` is the user's
    trainer step the current batch belongs to (None before the first)."""

    def __init__(self, config: BelayerConfig, client, plan: list[PlannedFault],
                 step_of: Callable[[], int | None], say=None) -> None:  # fmt: skip
        if any(planned.fault == "trainer-crash" for planned in plan):
            raise ChaosError(
                "trainer-crash has no target with the rollout API: the trainer is your own process"
            )
        super().__init__(config, client, run_id="", plan=plan, say=say)
        self.step_of = step_of

    async def _progress(self):
        """What `TrainingChaos` reads of a run, for the batches running now."""
        step = self.step_of()
        if step is None:
            return None
        running: list[str] = []
        with contextlib.suppress(Exception):  # a batch ending between the listing and the query
            async for execution in self.client.list_workflows(RUNNING_BATCHES):
                handle = self.client.get_workflow_handle(execution.id)
                running += (await handle.query(RolloutWorkflow.progress)).running
        return SimpleNamespace(iteration=step, phase="rollout", running=running)


class BackgroundChaos:
    """A `RolloutChaos` on an event loop of its own, for a synchronous trainer (TRL):
    `stop()` ends it and returns one record per planned fault."""

    def __init__(self, config: BelayerConfig, plan: str, step_of: Callable[[], int | None], say=None) -> None:
        planned = parse_plan(plan)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="belayer-chaos", daemon=True).start()

        async def started() -> RolloutChaos:
            client = await connect(config.temporal, config.storage.encryption_key)
            return RolloutChaos(config, client, planned, step_of, say)

        self.chaos = asyncio.run_coroutine_threadsafe(started(), self._loop).result()
        self._injecting = asyncio.run_coroutine_threadsafe(self.chaos.run(), self._loop)

    def stop(self) -> list[dict]:
        self._injecting.cancel()
        with contextlib.suppress(BaseException):
            self._injecting.result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        return self.chaos.settle()
