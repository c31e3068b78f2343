"""Chaos plans: which fault, when (a trajectory step or a time offset), against whom.

Inline: `engine-crash@step=2,sandbox-crash@step=4` or `s3-outage@t=10`. A file (.yaml):
`faults: [{fault: engine-crash, step: 2, target: TRAJECTORY_ID}]`. Without a target a
fault hits the first trajectory the run started. A training run (`belayer train`) takes
`FAULT@iteration=K` too: the fault hits during iteration K (or the first one after it
where it can: a trajectory in flight, or the train step for `trainer-crash`). `--chaos-rate R --chaos-seed S` draws a
seeded schedule over every fault kind instead.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from belayer.chaos.faults import FAULT_KINDS, TRAINING_FAULT_KINDS, ChaosError

_INLINE = re.compile(
    r"^(?P<fault>[a-z0-9-]+)@(?P<key>step|t|iteration|first-generation)=(?P<value>\d+(\.\d+)?)(:(?P<target>\S+))?$"
)


class PlannedFault(BaseModel):
    fault: str
    step: int | None = Field(None, ge=1, description="Inject once the target reaches this step.")
    t: float | None = Field(None, ge=0, description="Inject this many seconds after the run starts.")
    iteration: int | None = Field(None, ge=0, description="Training runs: inject during this iteration.")
    first_generation: int | None = Field(
        None,
        ge=0,
        description="Training runs: inject during this iteration while a trajectory of a task the "
        "policy acts in (not a trace task) is at its first generation, before its first action.",
    )
    target: str | None = Field(None, description="Trajectory id; default the first one started.")

    @model_validator(mode="after")
    def _one_trigger(self) -> PlannedFault:
        if self.fault not in TRAINING_FAULT_KINDS:
            raise ValueError(f"unknown fault {self.fault!r}; choose one of {', '.join(TRAINING_FAULT_KINDS)}")
        if [self.step, self.t, self.iteration, self.first_generation].count(None) != 3:
            raise ValueError(
                f"fault {self.fault}: give exactly one of step, t, iteration or first_generation"
            )
        return self


def parse_plan(text: str) -> list[PlannedFault]:
    """A plan from a file path or an inline comma-separated list."""
    path = Path(text)
    try:
        if path.suffix in (".yaml", ".yml") and path.is_file():
            document = yaml.safe_load(path.read_text()) or {}
            return [PlannedFault(**item) for item in document.get("faults", [])]
        return [_parse_inline(part.strip()) for part in text.split(",") if part.strip()]
    except (ValidationError, ValueError, TypeError) as exc:
        raise ChaosError(f"invalid chaos plan {text!r}: {exc}") from None


def _parse_inline(part: str) -> PlannedFault:
    match = _INLINE.match(part)
    if not match:
        raise ChaosError(
            f"chaos plan entry {part!r} is not FAULT@step=N, FAULT@iteration=K, FAULT@first-generation=K "
            "or FAULT@t=SECONDS[:TARGET]"
        )
    value, key = match["value"], match["key"].replace("-", "_")
    trigger = {key: float(value) if key == "t" else int(float(value))}
    return PlannedFault(fault=match["fault"], target=match["target"], **trigger)


def random_training_plan(rate: float, seed: int, iterations: int) -> list[PlannedFault]:
    """`random_plan` over a training run: about `rate` faults per iteration, the trainer's
    crash among the kinds."""
    return [
        PlannedFault(fault=p.fault, iteration=p.step - 1)
        for p in random_plan(rate, seed, iterations, TRAINING_FAULT_KINDS)
    ]


def random_plan(
    rate: float, seed: int, steps: int, kinds: tuple[str, ...] = FAULT_KINDS
) -> list[PlannedFault]:
    """About `rate` faults per step over `steps` steps, kinds drawn in turn from a seeded shuffle."""
    if not 0 < rate <= 1:
        raise ChaosError(f"--chaos-rate must be in (0, 1], got {rate}")
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    plan = []
    for step in range(1, steps + 1):
        if rng.random() < rate:
            plan.append(PlannedFault(fault=order[len(plan) % len(order)], step=step))
    return plan
