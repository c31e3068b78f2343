"""How long a leader may stay silent before it is declared hung, from what it really does.

An engine reports between steps (tokens, or a heartbeat), so while it is healthy its
longest silence is one step. A fixed deadline cannot fit every case: 2 s suits the tiny
model, the bench model's prefill on 2 cores needs tens of seconds, and under load a busy
engine's steps stretch, so a fixed deadline either waits far too long for a small engine
or declares a busy large one hung. `HangDeadline` derives the deadline from the step times
the node has seen, separately for decode steps and for the prompt tokens a step prefills:

    deadline = clamp(MULTIPLE * (slowest recent decode step
                                 + pending prompt tokens * recent prefill cost per token)
                     + heartbeat interval, floor, ceiling)

A step that prefills also decodes the batch's other sequences, so a prefill's cost is what
its step took beyond the slowest recent decode step, and the cost per token is that excess
over the recent prefill steps divided by the tokens they prefilled. Dividing each step's
whole time by its own tokens instead charges a turn's few uncached tokens (the prefix cache
holds the rest) with a whole decode step: about 10 ms a token where 1 ms is real, so a few
pending prompts put the deadline at the ceiling, and a hung engine went unnoticed for 60 s.

The history belongs to the node (same model, same machine), not to one engine, so a leader
that took over inherits it. Until both kinds are observed the deadline is the ceiling
(`rollout.heartbeat_timeout_s`), which stays the upper bound in every case.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# A silence this many times the slowest recent step is a hang, not load. Load that appears
# at once (a busy-loop process per core) stretched the bench model's decode steps up to ~6x
# (0.12 s -> 0.67 s), which the floor absorbs; the window then follows the new step times.
MULTIPLE = 4.0
# Never below this, whatever the steps (`rollout.hang_floor_s`): scheduler stalls and GC
# pauses of a healthy engine.
FLOOR_S = 2.0
DECODE_WINDOW = 256
PREFILL_WINDOW = 64


@dataclass(frozen=True)
class Deadlines:
    """What `belayer status` shows: the deadline now and its inputs."""

    current_s: float
    decode_step_s: float | None
    prefill_s_per_1k_tokens: float | None
    pending_prefill_tokens: int


class HangDeadline:
    """Step-time history of a node and the silence it allows its leader."""

    def __init__(
        self,
        ceiling_s: float,
        heartbeat_interval_s: float,
        floor_s: float = FLOOR_S,
        multiple: float = MULTIPLE,
    ):
        self.ceiling_s = ceiling_s
        self.floor_s = min(floor_s, ceiling_s)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.multiple = multiple
        self._decode: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._prefills: deque[tuple[float, int]] = deque(maxlen=PREFILL_WINDOW)  # (excess s, tokens)
        self._pending: dict[str, int] = {}  # engine request id -> prompt tokens not yet prefilled

    def sent(self, engine_request_id: str, prompt_tokens: int) -> None:
        """The leader was given a prompt: its next steps prefill it (counted whole: the
        prefix cache may have none of it, as after a takeover)."""
        self._pending[engine_request_id] = prompt_tokens

    def stepped(self, seconds: float, prefilled_tokens: int, engine_request_ids: list[str]) -> None:
        """A step of `seconds` gave tokens to these requests, computing `prefilled_tokens`
        prompt tokens (the engine's count, prefix-cache hits excluded) for the new ones."""
        for rid in engine_request_ids:
            self._pending.pop(rid, None)
        if prefilled_tokens:
            decode = max(self._decode, default=0.0)
            self._prefills.append((max(0.0, seconds - decode), prefilled_tokens))
        else:
            self._decode.append(seconds)

    def _prefill_s_per_token(self) -> float | None:
        """The recent prefill steps' excess over decoding per token they prefilled; None
        before any."""
        if not self._prefills:
            return None
        return sum(s for s, _ in self._prefills) / sum(tokens for _, tokens in self._prefills)

    def deadlines(self, live: set[str]) -> Deadlines:
        """The deadline now; `live` are the engine request ids the leader still works on (an
        aborted or re-sent request no longer counts as pending)."""
        for gone in self._pending.keys() - live:
            del self._pending[gone]
        decode = max(self._decode) if self._decode else None
        per_token = self._prefill_s_per_token()
        pending = sum(self._pending.values())
        if decode is None or (pending and per_token is None):
            current = self.ceiling_s  # not yet seen what this engine's steps cost
        else:
            expected = decode + pending * (per_token or 0.0)
            current = self.multiple * expected + self.heartbeat_interval_s
            current = min(self.ceiling_s, max(self.floor_s, current))
        return Deadlines(
            current_s=current,
            decode_step_s=decode,
            prefill_s_per_1k_tokens=None if per_token is None else per_token * 1000,
            pending_prefill_tokens=pending,
        )
