"""The policy the trainer optimises: the project's Llama model in fp32, and per-token
logprobs of one sequence.

Bit-identical results are the contract (a run with faults must end with the weights of
the run without), so everything that changes the order of floating-point sums is fixed:
deterministic torch algorithms, a fixed number of threads, eager attention, and one
sequence per forward pass (no padding, so a sequence's numbers never depend on which
other sequences share its batch).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def resolve_device(device: str) -> torch.device:
    """ "auto" is CUDA when torch sees a GPU, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"trainer device must be cpu, cuda or auto, not {device!r}")
    return torch.device(device)


def make_deterministic(threads: int) -> None:
    """Fix what the last bits of a result depend on, before any tensor work."""
    # cuBLAS is only deterministic with a fixed workspace; it reads this when it starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def load_policy(model_dir: Path, device: torch.device, state: dict | None = None):
    """`LlamaForCausalLM` from the built model's folder in fp32 on `device`, with the
    tensors of `state` (HF names) instead of the folder's weights when given."""
    from transformers import LlamaForCausalLM  # import cost: transformers, ~2 s

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    if state is not None:
        model.load_state_dict(state, strict=True)
    model.to(device)
    model.eval()  # no dropout anywhere; the same graph for old logprobs and the update
    return model


def token_logprobs(model, tokens: list[int], temperature: float) -> torch.Tensor:
    """logprob of tokens[1:] each under softmax(logits / temperature) of its prefix: element
    i is the logprob of token i + 1 (token 0 has no prefix and is never trained on)."""
    return _token_distributions(model, tokens, temperature)[0]


def token_logprobs_and_entropy(
    model, tokens: list[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` (the very same numbers) and, at each position, the entropy of the
    policy's whole next-token distribution there: how sure of itself the policy is."""
    logprobs, distributions = _token_distributions(model, tokens, temperature)
    return logprobs, -(distributions.exp() * distributions).sum(dim=-1)


def _token_distributions(model, tokens: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    distributions = torch.log_softmax(logits, dim=-1)
    return distributions.gather(1, ids[0, 1:, None])[:, 0], distributions
