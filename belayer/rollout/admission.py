"""What a rollout node declares it can serve, and the admission that holds it to that.

An engine given more requests than it batches (`max_num_seqs`) or than its KV cache
holds queues them silently: the turn waits behind others while another node may sit
idle, and the caller only finds out from its affinity timeout. A node instead admits a
request at once or refuses it (`NodeFull`): the generate activity then sends the turn
to the shared queue, where a node with room takes it, or retries it with backoff.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from belayer.rollout.config import RolloutConfig

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Capacity:
    """Concurrent sequences and KV tokens (every open request counted whole, as if no
    prefix were shared: the bound holds whatever the prefix cache finds)."""

    sequences: int
    kv_tokens: int

    @classmethod
    def of(cls, config: RolloutConfig, model_dir: Path) -> Capacity:
        return cls(sequences=config.max_num_seqs, kv_tokens=kv_tokens(config, model_dir))

    def refusal(self, open_lengths: list[int], prompt_tokens: int) -> str | None:
        """Why a request of `prompt_tokens` cannot be admitted beside open requests of
        `open_lengths` tokens (prompt and tokens so far), or None when it can."""
        if len(open_lengths) >= self.sequences:
            return f"{len(open_lengths)} sequences in flight, its capacity (rollout.max_num_seqs = {self.sequences})"
        held = sum(open_lengths)
        if held + prompt_tokens > self.kv_tokens:
            return (
                f"{held} KV tokens held and {prompt_tokens} asked, over its {self.kv_tokens} "
                "(rollout.kv_cache_mb)"
            )
        return None


def kv_tokens(config: RolloutConfig, model_dir: Path) -> int:
    """Tokens the node's KV arena holds: its bytes over each token's keys and values."""
    return (config.kv_cache_mb << 20) // kv_bytes_per_token(model_dir, config.dtype)


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes one token's keys and values take in every layer of the model, in `dtype`."""
    model = json.loads((Path(model_dir) / "config.json").read_text())
    heads = model.get("num_key_value_heads") or model["num_attention_heads"]
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    return 2 * model["num_hidden_layers"] * heads * head_dim * DTYPE_BYTES[dtype]
