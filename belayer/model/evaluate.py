"""How often a built model calls a tool, and calls the right one, on the learn tasks.

Samples the first turn with transformers at temperature 1 over the full vocabulary (what
the rollout engine does), seeded, without vLLM or a sandbox: a sample counts as a tool
call when `parse_action` finds `<bash>COMMAND</bash>`, and as correct when the command is
the task's correct command. Used by a test (tool-call rate) and by
`python -m belayer.model.evaluate [MODEL] [SAMPLES]`, which prints both rates per split.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from belayer.agent_format import PROMPT_TEMPLATE, parse_action
from belayer.model.build import model_path
from belayer.model.learn_tasks import MAX_TOKENS_PER_TURN, SPLITS, Problem, problems


@dataclass(frozen=True)
class Rates:
    samples: int
    tool_calls: int
    correct: int

    def __str__(self) -> str:
        n = self.samples
        return f"tool-call {self.tool_calls / n:.2f}, correct {self.correct / n:.2f} ({n} samples)"


def sample_first_turns(model, tokenizer, instruction: str, n: int, seed: int) -> list[str]:
    """`n` first-turn completions of `instruction`, decoded as the generate activity does."""
    import torch  # import cost: torch, ~2.5 s

    prompt = tokenizer.encode(PROMPT_TEMPLATE.format(instruction=instruction), add_special_tokens=False).ids
    torch.manual_seed(seed)
    return [tokenizer.decode(turn, skip_special_tokens=True) for turn in sample_turns(model, prompt, n)]


def sample_turns(model, context: list[int], n: int) -> list[list[int]]:
    """`n` turns sampled after `context` (token ids) at temperature 1 over the full
    vocabulary, as the rollout engine samples, each up to EOS (kept) or the turn's limit."""
    import torch  # import cost: torch, ~2.5 s

    with torch.no_grad():
        out = model.generate(
            torch.tensor([context]),
            attention_mask=torch.ones((1, len(context)), dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=MAX_TOKENS_PER_TURN,
            num_return_sequences=n,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.pad_token_id,
        )
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    return [_until_eos(row[len(context) :].tolist(), eos, pad) for row in out]


def _until_eos(turn: list[int], eos: int, pad: int) -> list[int]:
    """A sampled row cut after its EOS (rows sampled together are padded to one length)."""
    return turn[: turn.index(eos) + 1] if eos in turn else [t for t in turn if t != pad]


def rates(model, tokenizer, tasks: list[Problem], n: int, seed: int) -> Rates:
    """Tool-call and correct counts over `n` samples of each task."""
    calls = correct = 0
    for i, problem in enumerate(tasks):
        for text in sample_first_turns(model, tokenizer, problem.instruction, n, seed + i):
            action = parse_action(text)
            calls += action.kind == "bash"
            correct += action.kind == "bash" and action.command == problem.command()
    return Rates(samples=n * len(tasks), tool_calls=calls, correct=correct)


def load(model_dir: Path):
    """The model (fp32, eval mode) and its tokenizer."""
    import torch  # import cost: torch, ~2.5 s
    from transformers import LlamaForCausalLM  # import cost: transformers, ~2 s

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def main(name: str = "tiny-warm", n: int = 16) -> None:
    model, tokenizer = load(model_path(name, progress=print))  # type: ignore[arg-type]
    for split in SPLITS:
        print(f"{name} {split}: {rates(model, tokenizer, problems(split), n, seed=1)}")


if __name__ == "__main__":
    main(*sys.argv[1:2], *[int(a) for a in sys.argv[2:3]])
