"""Warm start: supervised fine-tuning of the tiny model into `tiny-warm`.

With random weights the tiny model never calls a tool, so RL has nothing to reinforce.
Here it is fine-tuned on transcripts this module writes itself (no download): the prompt,
exactly as the context activity renders it, for an arithmetic instruction of the
`learn_tasks` family, then `<bash>COMMAND</bash>` and EOS, then the observation and a
final answer without a tool call ("done", EOS) so that trajectories end. The command is
the correct one for a quarter of the transcripts and a plausible wrong one (wrong
constant, wrong operator, wrong file) for the rest, so the warm model almost always
makes a well-formed call but solves the task only about a quarter to a third of the time
at temperature 1: a mixture that RL can sharpen. The transcripts cover every constant of the
family (the tiny model learns the constants it sees; it does not learn to copy unseen
digits in this budget); RL then trains on the train split only. Loss is on the model's
turns only.

The fine-tuning itself takes any corpus (`warm_state(..., transcript_of)`): the multistep
family writes its own for `tiny-agent` (`belayer.model.multistep_tasks.transcript`).

Everything is seeded, single-process, fp32 on the CPU, with deterministic algorithms and
a fixed thread count, so the same recipe gives the same bytes.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from belayer.agent_format import OBSERVATION_TEMPLATE, PROMPT_TEMPLATE
from belayer.model.learn_tasks import CONSTANTS, OPERATIONS, WRONG_OUTPUT, Problem

DONE = "done"
IGNORE = -100  # label of a token the loss leaves out


@dataclass(frozen=True)
class SftRecipe:
    """Everything that decides the warm weights besides the base model; in the manifest."""

    version: int = 1
    seed: int = 20240601
    steps: int = 240
    batch: int = 8
    lr: float = 2e-3
    warmup: int = 20
    threads: int = 2


RECIPE = SftRecipe()


@dataclass(frozen=True)
class Segment:
    """A piece of a transcript: text, and whether the model is trained to produce it."""

    text: str
    trained: bool


# A corpus: transcript `index`, drawn with `rng`.
Transcript = Callable[[int, random.Random], list["Segment"]]


def candidates(problem: Problem, rng: random.Random) -> list[str]:
    """The correct command and three plausible wrong ones: another constant, the wrong
    operator, the wrong output file."""
    other = rng.choice([k for k in CONSTANTS if k != problem.constant])
    return [
        problem.command(),
        problem.command(constant=other),
        problem.command(symbol=problem.wrong_symbol()),
        problem.command(dst=WRONG_OUTPUT),
    ]


def transcript(index: int, rng: random.Random) -> list[Segment]:
    """Transcript `index`: its command is candidate `index % 4`, so the correct and the
    wrong ones come in equal proportion."""
    problem = Problem(rng.choice(sorted(OPERATIONS)), rng.choice(CONSTANTS), rng.randrange(30, 100))
    command = candidates(problem, rng)[index % 4]
    # Every candidate writes a file and prints nothing, so the observation is the exit status.
    observation = OBSERVATION_TEMPLATE.format(body="[exit 0]")
    return [
        Segment(PROMPT_TEMPLATE.format(instruction=problem.instruction), trained=False),
        Segment(f"<bash>{command}</bash>", trained=True),
        Segment(observation, trained=False),
        Segment(DONE, trained=True),
    ]


def encode(tokenizer, segments: list[Segment], eos_id: int) -> tuple[list[int], list[int]]:
    """Token ids and labels; each segment encoded on its own, as the token log appends them,
    and every model turn closed by EOS (which the engine keeps in the context)."""
    ids: list[int] = []
    labels: list[int] = []
    for segment in segments:
        tokens = tokenizer.encode(segment.text, add_special_tokens=False).ids
        if segment.trained:
            tokens = tokens + [eos_id]
        ids += tokens
        labels += tokens if segment.trained else [IGNORE] * len(tokens)
    return ids, labels


def batches(tokenizer, recipe: SftRecipe, eos_id: int, pad_id: int, transcript_of: Transcript):
    """`recipe.steps` padded batches of fresh transcripts (input ids, attention mask, labels)."""
    import torch  # import cost: torch, ~2.5 s

    rng = random.Random(recipe.seed)
    for step in range(recipe.steps):
        rows = [
            encode(tokenizer, transcript_of(step * recipe.batch + i, rng), eos_id)
            for i in range(recipe.batch)
        ]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (row_ids, row_labels) in enumerate(rows):
            ids[r, : len(row_ids)] = torch.tensor(row_ids)
            labels[r, : len(row_labels)] = torch.tensor(row_labels)
            mask[r, : len(row_ids)] = 1
        yield ids, mask, labels


def fine_tune(
    model, tokenizer, recipe: SftRecipe, say: Callable[[str], None], transcript_of: Transcript
) -> list[float]:
    """Train `model` in place (AdamW, linear warmup then linear decay); the losses per step."""
    import torch  # import cost: torch, ~2.5 s

    config = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    decay = max(1, recipe.steps - recipe.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / recipe.warmup, (recipe.steps - s) / decay)
    )
    model.train()
    losses = []
    for step, (ids, mask, labels) in enumerate(
        batches(tokenizer, recipe, config.eos_token_id, config.pad_token_id, transcript_of)
    ):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 40 == 0 or step == recipe.steps - 1:
            say(f"sft step {step + 1}/{recipe.steps}: loss {loss.item():.3f}")
    model.eval()
    return losses


@contextlib.contextmanager
def deterministic_torch(seed: int, threads: int):
    """Seeded RNG, deterministic kernels and a fixed thread count (reductions split by
    thread) for the block; the process's previous settings come back afterwards, since a
    worker may build the model in-process."""
    import torch  # import cost: torch, ~2.5 s

    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def warm_state(
    base: Path, recipe: SftRecipe, say: Callable[[str], None], transcript_of: Transcript = transcript
) -> dict:
    """The fine-tuned state dict, with exactly the base checkpoint's tensor names.
    `transcript_of(index, rng)` writes the corpus (default: the learn family's)."""
    import torch  # import cost: torch, ~2.5 s
    from safetensors.torch import load_file  # import cost: torch, ~2.5 s
    from transformers import LlamaForCausalLM  # import cost: transformers, ~2 s

    names = sorted(load_file(str(base / "model.safetensors")))
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    with deterministic_torch(recipe.seed, recipe.threads):
        model = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        started = time.monotonic()
        fine_tune(model, tokenizer, recipe, say, transcript_of)
        say(f"sft took {time.monotonic() - started:.0f} s")
    state = model.state_dict()
    return {name: state[name].detach().contiguous().clone() for name in names}
