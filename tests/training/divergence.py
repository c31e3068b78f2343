"""Whether a faulted training run ended as the fault-free one did, or parted from it only
at a near-tie the README's determinism contract allows.

After an engine or node recovery, the engine prefills what the uninterrupted run had
decoded, and the two kernels agree to ~1e-4 in logprob, not bit for bit. A token whose
two best choices (logprob plus the position's Gumbel noise, the same in both runs) lie
closer than that can flip, and everything after it differs: the faulted run's weights
are then another run's, honestly. Telling that apart from a real divergence (another
context, other weights, a lost turn) takes the trajectories' tokens and seeds: at the
first token the runs part, the margin between the two choices must be a hair's breadth.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path

from belayer.model.build import model_path
from belayer.rollout.noise import gumbel_noise
from belayer.seeding import digest
from belayer.storage.store import open_store
from belayer.storage.tokenlog import PrefixRef
from belayer.storage.trajectory_tokens import TrajectoryTokens, read_trajectory_tokens
from belayer.workflows.models import TrajectoryResult

# Twice the engines' logprob agreement after a prefill (README: 1e-4), with room: a real
# divergence parts at a margin of order 1, the noise's scale.
NEAR_TIE = 1e-3
TRAJECTORY_ID = re.compile(r"-i(?P<iteration>\d{5})-(?P<task>.+)-m(?P<member>\d+)-a(?P<attempt>\d+)$")


@dataclass(frozen=True)
class Divergence:
    iteration: int
    trajectory: str  # the calm run's id
    position: int
    tokens: tuple[int, int]  # (calm, faulted)
    logprobs: tuple[float | None, float | None]
    margin: float  # |(calm's logprob + noise) - (faulted's logprob + noise)| of the two tokens

    def near_tie(self) -> bool:
        return self.margin < NEAR_TIE


def assert_same_result_or_a_near_tie(
    config, calm: dict, stormy: dict, *, seed: int, model: str
) -> Divergence | None:
    """Equal per-iteration rewards and weights and final weights; or, where they differ,
    the runs' tokens parted first at a verified near-tie, and everything before its
    iteration is equal. Returns the near-tie (None when the results are identical)."""

    def outcome(report, upto=None):
        return [(i["rewards"], i["weights_sha256"]) for i in report["iterations"][:upto]]

    if outcome(stormy) == outcome(calm) and stormy["final_weights_sha256"] == calm["final_weights_sha256"]:
        return None
    found = first_divergence(config, calm["run_id"], stormy["run_id"], seed=seed, model=model)
    assert found is not None, (
        "the faulted run's weights differ from the fault-free run's though every trajectory drew "
        f"the same tokens: {outcome(stormy)} against {outcome(calm)}"
    )
    assert found.near_tie(), f"the runs part at a real divergence, not a near-tie: {found}"
    assert outcome(stormy, found.iteration) == outcome(calm, found.iteration), (
        f"the results differ before the iteration of the first token that did: {found}"
    )
    return found


def first_divergence(config, calm_run: str, stormy_run: str, *, seed: int, model: str) -> Divergence | None:
    """The first token (by iteration, then trajectory) at which the two runs' trajectories
    part, with the margin of the two choices there; None when every trajectory agrees."""
    calm, stormy = (asyncio.run(_contexts(config, run)) for run in (calm_run, stormy_run))
    assert calm.keys() == stormy.keys(), (sorted(calm), sorted(stormy))
    vocab = json.loads((Path(model_path(model)) / "config.json").read_text())["vocab_size"]
    with open_store(config.storage, encrypted=False) as store:
        for key in sorted(calm):
            (calm_id, calm_ref), (_, stormy_ref) = calm[key], stormy[key]
            ours, theirs = read_trajectory_tokens(store, calm_ref), read_trajectory_tokens(store, stormy_ref)
            at = _first_difference(ours.tokens, theirs.tokens)
            if at is not None:
                return _divergence(key, calm_id, ours, theirs, at, seed=seed, vocab=vocab)
    return None


def _first_difference(a: list[int], b: list[int]) -> int | None:
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return at if at is not None or len(a) == len(b) else min(len(a), len(b))


def _divergence(key, calm_id: str, calm: TrajectoryTokens, stormy: TrajectoryTokens, at: int, *, seed: int,
                vocab: int) -> Divergence:  # fmt: skip
    iteration, task, member = key
    if at >= min(len(calm.tokens), len(stormy.tokens)) or not (calm.mask[at] and stormy.mask[at]):
        # one ended where the other went on, or an observation differs: not a sampling flip
        return Divergence(iteration, calm_id, at, (-1, -1), (None, None), margin=float("inf"))
    generation = sum(1 for i in range(at + 1) if calm.mask[i] and (i == 0 or not calm.mask[i - 1])) - 1
    turn_seed = digest(seed, iteration, task, member) % 2**31 + generation
    noise = gumbel_noise(turn_seed, at, vocab)
    a, b = calm.tokens[at], stormy.tokens[at]
    margin = abs((calm.logprobs[at] + float(noise[a])) - (stormy.logprobs[at] + float(noise[b])))
    return Divergence(iteration, calm_id, at, (a, b), (calm.logprobs[at], stormy.logprobs[at]), margin)


async def _contexts(config, run_id: str) -> dict[tuple[int, str, int], tuple[str, PrefixRef]]:
    """Per (iteration, task, member): the id and token log of the trajectory that counted
    (the last attempt that did not fail on infrastructure)."""
    from belayer.temporal_client import connect

    client = await connect(config.temporal)
    query = f"BelayerRun = '{run_id}' AND WorkflowType = 'TrajectoryWorkflow'"
    ids = sorted({w.id async for w in client.list_workflows(query)})
    found: dict[tuple[int, str, int], tuple[int, str, PrefixRef]] = {}
    for workflow_id in ids:
        parts = TRAJECTORY_ID.search(workflow_id)
        result = await client.get_workflow_handle(workflow_id, result_type=TrajectoryResult).result()
        if result.status == "failed_infra" or result.context is None:
            continue
        key = (int(parts["iteration"]), parts["task"], int(parts["member"]))
        attempt = int(parts["attempt"])
        if key not in found or found[key][0] < attempt:
            found[key] = (attempt, workflow_id, result.context)
    return {key: (workflow_id, ref) for key, (_, workflow_id, ref) in found.items()}
