"""The adaptive checkpoint policy: pure, deterministic, serialisable.

It lives inside the trajectory workflow's state, so it does no I/O, reads no clock and
draws no random numbers: every input is a measurement the workflow hands it. After each
action the workflow asks `decide()`; the answer says whether to checkpoint now (the
checkpoint then runs while the next generation does) and why. Every decision is kept
as a `DecisionRecord` so reports can show predicted against actual times.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from belayer.policy.config import PolicyConfig

Verdict = Literal["checkpoint", "skip", "forced"]


class GenerationSample(BaseModel):
    """One measured generation: what the engine produced and how long it took."""

    output_tokens: int = Field(ge=0)
    per_token_s: float = Field(ge=0)
    queue_s: float = Field(0.0, ge=0)
    total_s: float = Field(ge=0)


class CheckpointSample(BaseModel):
    """One measured checkpoint: dump + upload time against the sandbox's size."""

    duration_s: float = Field(ge=0)
    size_mb: float = Field(ge=0)
    capture_s: float | None = Field(
        None,
        ge=0,
        description="Of the duration, the capture the next action waited for (a staged "
        "checkpoint); None for a checkpoint taken in one call, which the next action waits for whole.",
    )


class DecisionRecord(BaseModel):
    """One decision, completed later with what actually happened."""

    step: int
    verdict: Verdict
    reason: str
    predicted_generation_s: float
    estimated_checkpoint_s: float
    unprotected_steps: int
    unprotected_replay_s: float
    actual_checkpoint_s: float | None = None
    actual_capture_s: float | None = None  # of it, the capture (a staged checkpoint)
    actual_checkpoint_mb: float | None = None
    actual_generation_s: float | None = None
    wait_s: float | None = None

    @property
    def checkpointed(self) -> bool:
        return self.verdict != "skip"


class PredictorError(BaseModel):
    """Running sums of both predictors' relative errors, so the decisions themselves need
    not be kept to report them (a trajectory's decisions live in its log)."""

    generation_sum: float = 0.0
    generation_n: int = 0
    checkpoint_sum: float = 0.0
    checkpoint_n: int = 0

    def add_generation(self, predicted: float, actual: float) -> None:
        if actual:
            self.generation_sum += abs(predicted - actual) / actual
            self.generation_n += 1

    def add_checkpoint(self, estimated: float, actual: float) -> None:
        if actual:
            self.checkpoint_sum += abs(estimated - actual) / actual
            self.checkpoint_n += 1

    def means(self) -> dict[str, float | None]:
        return {
            "generation_mean_rel_error": self.generation_sum / self.generation_n
            if self.generation_n
            else None,
            "checkpoint_mean_rel_error": self.checkpoint_sum / self.checkpoint_n
            if self.checkpoint_n
            else None,
        }


class CheckpointPolicy(BaseModel):
    """Predictors, unprotected-work accounting and the latest decisions of one trajectory.

    `decisions` holds the recent ones only: the workflow moves completed decisions to the
    trajectory's log and drops them here (`forget_decisions`), so the state stays bounded.
    """

    config: PolicyConfig = PolicyConfig()
    generations: list[GenerationSample] = []
    checkpoints: list[CheckpointSample] = []
    unprotected_steps: int = 0
    unprotected_replay_s: float = 0.0
    decisions: list[DecisionRecord] = []
    decided: int = Field(0, description="Decisions made so far; the last of them is decisions[-1].")
    checkpointed: int = Field(0, description="Decisions so far that took a checkpoint.")
    error: PredictorError = PredictorError()

    # -- measurements the workflow reports -------------------------------------------

    def observe_generation(self, sample: GenerationSample) -> None:
        self.generations = [*self.generations, sample][-self.config.history :]
        if self.decisions and self.decisions[-1].actual_generation_s is None:
            self.decisions[-1].actual_generation_s = sample.total_s
            self.error.add_generation(self.decisions[-1].predicted_generation_s, sample.total_s)

    def observe_action(self, duration_s: float) -> None:
        """An action ran: it is unprotected until the next checkpoint covers it."""
        self.unprotected_steps += 1
        self.unprotected_replay_s += max(duration_s, 0.0)

    def observe_checkpoint(
        self, sample: CheckpointSample, wait_s: float = 0.0, decision: int | None = None
    ) -> None:
        """The checkpoint of decision number `decision` (default: the last) finished;
        everything before it is protected."""
        self.checkpoints = [*self.checkpoints, sample][-self.config.history :]
        record = self._checkpointing(decision)
        if record is not None:
            record.actual_checkpoint_s = sample.duration_s
            record.actual_capture_s = sample.capture_s
            record.actual_checkpoint_mb = sample.size_mb
            record.wait_s = wait_s
            self.error.add_checkpoint(record.estimated_checkpoint_s, sample.duration_s)

    def observe_checkpoint_failed(self, decision: int | None = None) -> None:
        """The checkpoint of decision number `decision` (default: the last) failed: its
        actions are unprotected again."""
        record = self._checkpointing(decision)
        if record is not None:
            self.unprotected_steps += record.unprotected_steps
            self.unprotected_replay_s += record.unprotected_replay_s
            record.reason += "; failed"

    def _checkpointing(self, decision: int | None) -> DecisionRecord | None:
        """Decision number `decision` (the last when None), if it is held and took a checkpoint."""
        index = len(self.decisions) - 1 if decision is None else decision - self.first_held
        if 0 <= index < len(self.decisions) and self.decisions[index].checkpointed:
            return self.decisions[index]
        return None

    @property
    def first_held(self) -> int:
        """The number of `decisions[0]` (decisions are numbered from 1 as they are made)."""
        return self.decided - len(self.decisions) + 1

    def at_bound(self) -> bool:
        """The unprotected work has reached a bound: the next decision takes a checkpoint
        whatever it costs, after waiting for one still being stored if it must."""
        return self._bound_reached() is not None

    def skips_past_storing(self) -> bool:
        """Whether the next decision goes ahead while the checkpoint before it is still
        being stored (its publish outlasted the action), instead of waiting for it:
        adaptive does, short of a bound (`decide` then skips, as one checkpoint is in
        flight at a time); every-step waits, as its next checkpoint is due at once."""
        return self.config.mode == "adaptive" and not self.at_bound()

    def _bound_reached(self) -> str | None:
        """Why the unprotected work has reached a bound; None when it has not."""
        cfg = self.config
        if self.unprotected_steps >= cfg.max_unprotected_steps:
            return f"{self.unprotected_steps} unprotected steps reach the bound"
        if self.unprotected_replay_s >= cfg.max_unprotected_replay_s:
            return f"unprotected replay {self.unprotected_replay_s:.1f}s reaches the bound"
        return None

    def mark_protected(self) -> None:
        """A checkpoint covering every action so far was taken (or a restore landed on one)."""
        self.unprotected_steps = 0
        self.unprotected_replay_s = 0.0

    # -- predictors -----------------------------------------------------------------

    def predict_generation_s(self, expected_output_tokens: int | None = None) -> float:
        """Coming generation interval: output length x per-token latency + queueing."""
        recent = self.generations
        per_token = _mean([g.per_token_s for g in recent]) if recent else self.config.prior_token_latency_s
        queue = _mean([g.queue_s for g in recent]) if recent else 0.0
        if expected_output_tokens is not None:
            tokens = float(expected_output_tokens)
        else:
            tokens = _mean([g.output_tokens for g in recent]) if recent else 0.0
        return tokens * per_token + queue

    def estimate_checkpoint_s(self, size_mb: float) -> float:
        """Dump + upload time for a sandbox of `size_mb`, scaled from recent checkpoints."""
        if not self.checkpoints:
            return self.config.prior_checkpoint_s
        mean_duration = _mean([c.duration_s for c in self.checkpoints])
        mean_size = _mean([c.size_mb for c in self.checkpoints])
        if mean_size <= 0 or size_mb <= 0:
            return mean_duration
        # A fixed part (freezing, CRIU start-up) does not shrink with size: never
        # estimate below half the recent mean.
        return max(mean_duration * size_mb / mean_size, mean_duration / 2)

    # -- the decision ----------------------------------------------------------------

    def decide(
        self,
        step: int,
        size_mb: float,
        expected_output_tokens: int | None = None,
        *,
        storing_step: int | None = None,
    ) -> DecisionRecord:
        """Checkpoint now (overlapped with the next generation) or skip, and why.
        `storing_step`: the checkpoint after that step is still being stored, and a
        sandbox has one checkpoint in flight at a time: this one skips (at the bound,
        `at_bound`, the caller waits for that checkpoint instead and passes None)."""
        predicted = self.predict_generation_s(expected_output_tokens)
        estimated = self.estimate_checkpoint_s(size_mb)
        verdict, reason = self._verdict(predicted, estimated, storing_step)
        record = DecisionRecord(
            step=step,
            verdict=verdict,
            reason=reason,
            predicted_generation_s=round(predicted, 6),
            estimated_checkpoint_s=round(estimated, 6),
            unprotected_steps=self.unprotected_steps,
            unprotected_replay_s=round(self.unprotected_replay_s, 6),
        )
        self.decisions = [*self.decisions, record]
        self.decided += 1
        if record.checkpointed:
            self.checkpointed += 1
            self.mark_protected()
        return record

    def forget_decisions(self, upto: int) -> None:
        """Drop decisions 1..upto (logged elsewhere); the latest one always stays."""
        drop = min(max(upto - self.first_held + 1, 0), len(self.decisions) - 1)
        self.decisions = self.decisions[drop:]

    def _verdict(self, predicted: float, estimated: float, storing_step: int | None) -> tuple[Verdict, str]:
        cfg = self.config
        if cfg.mode == "none":
            return "skip", "policy mode none"
        if self.unprotected_steps == 0:
            return "skip", "nothing unprotected"
        if storing_step is not None:
            return "skip", f"the checkpoint after step {storing_step} is still being stored"
        if cfg.mode == "every-step":
            return "checkpoint", "policy mode every-step"
        if predicted >= cfg.alpha * estimated:
            return "checkpoint", (f"generation {predicted:.3f}s >= {cfg.alpha} x checkpoint {estimated:.3f}s")
        bound = self._bound_reached()
        if bound is not None:
            return "forced", bound
        return "skip", f"generation {predicted:.3f}s < {cfg.alpha} x checkpoint {estimated:.3f}s"

    # -- reporting -------------------------------------------------------------------

    def predictor_error(self) -> dict[str, float | None]:
        """Mean absolute relative error of both predictors over every completed decision."""
        return self.error.means()


def predictor_error(decisions: list[DecisionRecord]) -> dict[str, float | None]:
    """The same means computed from a list of decisions (a trajectory's log)."""
    error = PredictorError()
    for d in decisions:
        if d.actual_generation_s:
            error.add_generation(d.predicted_generation_s, d.actual_generation_s)
        if d.actual_checkpoint_s:
            error.add_checkpoint(d.estimated_checkpoint_s, d.actual_checkpoint_s)
    return error.means()


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values)
