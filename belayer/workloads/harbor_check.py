"""The oracle and nop agents run against a Harbor task on one sandbox host, without Temporal
or an engine: `belayer tasks check`'s end-to-end validation of a dataset.

A sound task scores 1 with its oracle (solution/solve.sh) and 0 with nop (nothing done):
a task whose oracle fails has a broken solution or environment, and one whose untouched
environment already passes rewards doing nothing. Each step of a multi-step task runs in
order in one sandbox (its solution installed at /solution, its `workdir/` files into the
WORKDIR, its setup.sh run, its tests at verify time), stopping early below `min_reward`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from belayer.sandbox.models import Action, ImageSemantics, SandboxSpec
from belayer.workloads.drivers import ORACLE_ACTION, verifier_command
from belayer.workloads.harbor import HarborStep, HarborTaskDir
from belayer.workloads.harbor_reward import judge_check, task_reward
from belayer.workloads.harbor_tasks import pack, semantics_of, stage_files, store_files


@dataclass
class AgentCheck:
    """What one agent scored on one task: the task's reward, each step's, and why one had none."""

    agent: str
    reward: float = 0.0
    step_rewards: list[float | None] = field(default_factory=list)
    problem: str | None = None


def check_agent(host, task: HarborTaskDir, image: str, agent: str, builder) -> AgentCheck:
    """Run `agent` ("oracle" or "nop") through every step of `task` in one fresh sandbox."""
    result = AgentCheck(agent=agent)
    trajectory = f"tasks-check-{task.id}-{agent}-{uuid.uuid4().hex[:6]}"
    semantics: ImageSemantics = semantics_of(
        task, image, builder, agent_env=task.config.solution.env if agent == "oracle" else {}
    )
    spec = SandboxSpec(image=image, semantics=semantics, labels={"belayer.tasks-check": task.id})
    handle = host.create(spec)
    try:
        action_step = 0
        for index, step in enumerate(task.steps):
            uploads, setup = stage_files(host.store, step, agent, semantics.workdir)
            problem = host.begin_stage(handle, uploads, setup, first_setup_step=1000 * (index + 1) + 1)
            if problem is not None:
                result.problem = f"step {step.name}: {problem}"
                break
            if agent == "oracle":
                action_step += 1
                # [solution].env is in the agent's environment (semantics_of), as for a trajectory
                solved = host.exec(handle, Action(trajectory=trajectory, step=action_step, command=ORACLE_ACTION,
                                                  timeout_s=step.agent.timeout_sec or 600.0))  # fmt: skip
                if solved.timed_out:
                    result.problem = f"step {step.name}: the oracle's solve.sh timed out"
            action_step += 1
            reward, why = _verify(host, handle, step, semantics, trajectory, action_step)
            result.step_rewards.append(reward)
            if why and result.problem is None:
                result.problem = f"step {step.name}: {why}"
            if step.min_reward is not None and (reward or 0.0) < step.min_reward:
                break
    finally:
        host.destroy(handle)
    result.reward = task_reward(result.step_rewards, len(task.steps), task.config.multi_step_reward_strategy)
    return result


def _verify(host, handle, step: HarborStep, semantics: ImageSemantics, trajectory: str,
            action_step: int) -> tuple[float | None, str | None]:  # fmt: skip
    action = Action(trajectory=trajectory, step=action_step, command=verifier_command(step.verifier.env, semantics.workdir),
                    timeout_s=step.verifier.timeout_sec)  # fmt: skip
    graded = host.verify(
        handle, action, store_files(host.store, pack(list(step.tests_dirs))), processes="running"
    )
    reward, reason = judge_check(graded.files, timed_out=graded.observation.timed_out,
                                 timeout_s=step.verifier.timeout_sec, exit_code=graded.observation.exit_code)  # fmt: skip
    if reward is None:
        return None, f"{reason}: {graded.observation.stderr[-300:]}" if graded.observation.stderr else reason
    return reward.reward, None
