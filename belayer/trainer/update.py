"""One iteration's policy update, with the loss of the run's algorithm
(`TrainerSettings.algorithm`, belayer/trainer/algorithms/) on the advantages the
training workflow computed with the same algorithm's estimator.

The importance ratio is taken against the sampling policy *recomputed by the trainer*
(no grad, before any update), not against the engines' logprobs:

- every token of an iteration was sampled by the weights version the trainer holds (the
  loop publishes a version before it rolls out with it), so the trainer's own weights
  are the sampling policy, and recomputing it is exact;
- the engines' logprobs are only reproducible to ~1e-4 after a recovery (a replay
  prefills what the uninterrupted engine decoded, and the two kernels sum in different
  orders), so using them would make the update, and so the weights, depend on whether a
  fault happened. The engines' numbers are compared with the recomputed ones instead and
  reported as `engine_logprob_drift`.

A group with any model token from another version is left out whole (advantages are
relative within a group: a partial group would bias them). The loss of a minibatch is
the sum of its samples' algorithm losses, each its share of the minibatch (GRPO: the
token-level mean over the minibatch's model tokens of the clipped surrogate), plus
`kl_coef` times the k3 estimate of the KL to the initial weights when `kl_coef > 0`, bounded
per token (`bounded_k3`).
The batch is shuffled by the step's `minibatch_seed` and cut into minibatches, so each
mixes groups. Gradients accumulate one sample at a time in that order, then are clipped
to `max_grad_norm`, and AdamW steps once per minibatch.

An empty batch (every group skipped, or no model tokens) takes no optimizer step: the
weights stay as they are, yet the caller still writes a new checkpoint under the next
version, because the loop always advances one version per iteration.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from belayer.storage.errors import CorruptObject
from belayer.trainer.algorithms import PolicyLoss, TokenTerms, algorithm
from belayer.trainer.models import SkippedGroup, TrainerSettings
from belayer.trainer.policy import token_logprobs, token_logprobs_and_entropy
from belayer.trainer.samples import LoadedSample


@dataclass(frozen=True)
class StepStats:
    """What a step reports besides its checkpoint (the recorded part of a TrainStepResult)."""

    loss: float
    kl: float
    clip_fraction: float
    trained_tokens: int
    samples: int
    skipped: list[SkippedGroup]
    engine_logprob_drift: float | None
    # None in a checkpoint from before they were kept:
    entropy: float | None = None  # mean over trained tokens of the sampling policy's entropy there
    grad_norm: float | None = None  # mean over the minibatches that stepped, before clipping
    lr: float | None = None  # the step's learning rate (after decay)
    response_tokens: float | None = None  # model tokens per trained trajectory


@dataclass
class _Prepared:
    """A kept sample with what the loss needs as tensors aligned with tokens[1:]."""

    sample: LoadedSample
    mask: torch.Tensor
    old: torch.Tensor  # the sampling policy's logprobs (the trainer's weights, no grad)
    entropy: torch.Tensor  # the sampling policy's entropy at each position
    reference: torch.Tensor | None  # the initial weights' logprobs, when the KL term is on


def update_policy(
    model,
    optimizer,
    reference_model,
    version: int,
    samples: list[LoadedSample],
    settings: TrainerSettings,
    minibatch_seed: int = 0,
) -> StepStats:
    """Train `model` in place on `samples` (advantages already computed by the workflow)."""
    kept, skipped = split_by_version(samples, version)
    check_vocabulary(kept, model.config.vocab_size)
    prepared = [_prepare(model, reference_model, s, settings) for s in kept]
    drift = engine_drift(prepared)
    totals = {"loss": 0.0, "kl": 0.0, "clipped": 0, "tokens": 0, "steps": 0, "grad_norm": 0.0}
    loss = algorithm(settings.algorithm).loss
    for part in minibatch_slices(prepared, settings.minibatches, minibatch_seed):
        _minibatch(model, optimizer, part, loss, settings, totals)
    tokens, steps = totals["tokens"], totals["steps"]
    return StepStats(
        loss=totals["loss"] / steps if steps else 0.0,
        kl=totals["kl"] / tokens if tokens else 0.0,
        clip_fraction=totals["clipped"] / tokens if tokens else 0.0,
        trained_tokens=tokens,
        samples=len(kept),
        skipped=skipped,
        engine_logprob_drift=drift,
        entropy=sum(float((p.entropy * p.mask).sum()) for p in prepared) / tokens if tokens else None,
        grad_norm=totals["grad_norm"] / steps if steps else None,
        lr=optimizer.param_groups[0]["lr"],
        response_tokens=tokens / len(prepared) if prepared else None,
    )


def split_by_version(
    samples: list[LoadedSample], version: int
) -> tuple[list[LoadedSample], list[SkippedGroup]]:
    """The samples of groups sampled wholly by `version` (in the order given), and the
    groups left out with why."""
    foreign: dict[str, set[int]] = {}
    for s in samples:
        other = s.sampled_versions() - {version}
        if other:
            foreign.setdefault(s.sample.group, set()).update(other)
    skipped = [
        SkippedGroup(
            group=group,
            reason=f"sampled by weights version(s) {sorted(versions)}, but the "
            f"trainer holds version {version}",
        )
        for group, versions in foreign.items()
    ]
    return [s for s in samples if s.sample.group not in foreign], skipped


def check_vocabulary(samples: list[LoadedSample], vocab_size: int) -> None:
    """A token id the model has no embedding for means the log is not this model's."""
    for s in samples:
        outside = [t for t in s.tokens if t >= vocab_size]
        if outside:
            raise CorruptObject(
                f"token log {s.sample.context.key!r} holds token id {outside[0]}, outside the model's "
                f"vocabulary of {vocab_size}: it was not sampled for this model"
            )


def minibatch_slices(items: list, count: int, seed: int) -> list[list]:
    """`items` shuffled by `seed`, then cut into `count` slices: a minibatch mixes groups
    instead of holding whole ones in the order the workflow listed them."""
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    return contiguous_slices(shuffled, count)


def contiguous_slices(items: list, count: int) -> list[list]:
    """`items` cut into `count` contiguous slices, the first ones one longer when it does
    not divide (empty slices when there are fewer items than slices)."""
    size, extra = divmod(len(items), count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def engine_drift(prepared: list[_Prepared]) -> float | None:
    """Largest |engine logprob - trainer logprob| over the model tokens that have both."""
    drift = None
    for p in prepared:
        old = p.old.tolist()
        for position, engine in enumerate(p.sample.engine_logprobs[1:]):
            if engine is not None and p.sample.mask[position + 1]:
                gap = abs(engine - old[position])
                drift = gap if drift is None else max(drift, gap)
    return drift


def _prepare(model, reference_model, sample: LoadedSample, settings: TrainerSettings) -> _Prepared:
    device = next(model.parameters()).device
    mask = torch.tensor(sample.mask[1:], dtype=torch.float32, device=device)
    with torch.no_grad():
        old, entropy = token_logprobs_and_entropy(model, sample.tokens, settings.temperature)
        reference = (
            token_logprobs(reference_model, sample.tokens, settings.temperature)
            if settings.kl_coef > 0
            else None
        )
    return _Prepared(sample, mask, old, entropy, reference)


def _minibatch(
    model, optimizer, part: list[_Prepared], loss_of: PolicyLoss, settings: TrainerSettings, totals: dict
) -> None:
    """Accumulate the gradients of `part`'s samples, clip, step; no step without model tokens."""
    tokens = int(sum(p.mask.sum().item() for p in part))
    if tokens == 0:
        return
    loss_total = 0.0
    for p in part:
        if p.mask.sum().item() == 0:
            continue  # nothing of it is trained on; skipping it changes no number
        loss, kl, clipped = _sample_loss(model, p, loss_of, settings, tokens)
        loss.backward()
        loss_total += loss.item()
        totals["kl"] += kl
        totals["clipped"] += clipped
    totals["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    totals["loss"] += loss_total
    totals["tokens"] += tokens
    totals["steps"] += 1


# The k3 estimate of a token's KL to the reference, exp(r) - r - 1 with r = log(ref / policy),
# is unbounded: a token the policy sampled at a tiny probability that the reference liked
# makes exp(r) huge (a run at kl_coef 0.02 saw a KL of 18,796 and a gradient norm of
# 54,685 in one iteration, then lost what it had learned). As verl's low_var_kl does, r is
# clamped before the exponential and each token's term after it (the gradient of a clamped
# token is zero).
KL_LOG_RATIO_BOUND = 20.0
KL_TOKEN_BOUND = 10.0


def bounded_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per token, the k3 KL estimate of log_ratio = reference - policy logprob, bounded."""
    r = torch.clamp(log_ratio, -KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(r) - r - 1, max=KL_TOKEN_BOUND)


def _sample_loss(
    model, p: _Prepared, loss_of: PolicyLoss, settings: TrainerSettings, tokens: int
) -> tuple[torch.Tensor, float, int]:
    """(this sample's share of the minibatch loss, its summed k3 KL, its clipped tokens)."""
    logp = token_logprobs(model, p.sample.tokens, settings.temperature)
    terms = TokenTerms(logp=logp, old=p.old, mask=p.mask, advantage=p.sample.sample.advantage)
    loss, clipped = loss_of(terms, settings, tokens)
    kl = 0.0
    if p.reference is not None:
        k3 = bounded_k3(p.reference - logp) * p.mask
        loss = loss + settings.kl_coef * k3.sum() / tokens
        kl = k3.sum().item()
    return loss, kl, clipped
