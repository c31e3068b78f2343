"""The in-flight log: every request the node accepted and not yet answered, with what it
produced so far (tokens, their logprobs and weights versions). Every recovery and every
publish re-sends from it: prompt + tokens so far, the rest of the budget."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from belayer.rollout.errors import RolloutError
from belayer.rollout.protocol import AddRequest, SamplingSpec, TokenDelta


@dataclass(frozen=True)
class Completion:
    """What a request produced, and what the node went through to produce it."""

    request_id: str
    prompt_len: int
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_s: float
    decode_s_per_token: float
    recoveries: tuple[str, ...]
    logprobs: list[float] = field(default_factory=list)  # one per token
    versions: list[int] = field(default_factory=list)  # weights version of each token
    recovered_at: tuple[int, ...] = ()  # how many tokens it held at each recovery


@dataclass
class InFlight:
    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    submitted_at: float
    # Appended in this order (logprobs, versions, then tokens) so a lock-free reader that
    # copies tokens first always finds at least as many logprobs and versions.
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    engine_request_id: str | None = None  # set while the current leader works on it
    pinned_version: int | None = None  # finish_on_old: the version it must finish on
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    error: RolloutError | None = None
    recoveries: list[str] = field(default_factory=list)
    recovered_at: list[int] = field(default_factory=list)  # len(tokens) at each recovery
    done: threading.Event = field(default_factory=threading.Event)
    on_progress: Callable[[int], None] | None = None
    done_callbacks: list[Callable[[], None]] = field(default_factory=list)

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the request ends (from the node's thread), or now if it has
        ended; it may be called twice when the end races the registration."""
        self.done_callbacks.append(callback)
        if self.done.is_set():
            callback()

    def set_done(self) -> None:
        self.done.set()
        for callback in list(self.done_callbacks):
            callback()

    @property
    def remaining(self) -> int:
        return self.spec.max_tokens - len(self.tokens)

    def record(self, delta: TokenDelta, version: int) -> None:
        n = len(delta.token_ids)
        logprobs = list(delta.logprobs[:n]) + [float("nan")] * (n - len(delta.logprobs))
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * n)
        self.tokens.extend(delta.token_ids)


class InFlightLog:
    """Records by request id and by the id the current leader knows them under."""

    def __init__(self):
        self.records: dict[str, InFlight] = {}
        self.by_engine_id: dict[str, InFlight] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: InFlight) -> None:
        self.records[record.request_id] = record

    def get(self, request_id: str) -> InFlight | None:
        return self.records.get(request_id)

    def on_engine(self, engine_request_id: str) -> InFlight | None:
        return self.by_engine_id.get(engine_request_id)

    def open(self) -> list[InFlight]:
        return [r for r in self.records.values() if not r.done.is_set()]

    def unsent(self) -> list[InFlight]:
        return [r for r in self.records.values() if r.engine_request_id is None and not r.done.is_set()]

    def on_leader(self) -> list[InFlight]:
        return [r for r in self.records.values() if r.engine_request_id is not None]

    def detach(self, record: InFlight) -> None:
        """The leader no longer works on it (it died, or was told to abort): send it again."""
        if record.engine_request_id is not None:
            self.by_engine_id.pop(record.engine_request_id, None)
            record.engine_request_id = None

    def detach_all(self) -> None:
        for record in list(self.records.values()):
            self.detach(record)

    def request_for(self, record: InFlight, max_model_len: int) -> AddRequest | None:
        """The message that (re)starts `record` on the leader, or None when it is finished."""
        self.detach(record)
        prompt = record.prompt_ids + record.tokens
        if record.remaining <= 0 or len(prompt) >= max_model_len:
            self.finish(record, "length")
            return None
        record.engine_request_id = f"{record.request_id}#{next(self._ids)}"
        self.by_engine_id[record.engine_request_id] = record
        return AddRequest(record.engine_request_id, prompt, record.spec, record.remaining)

    def finish(self, record: InFlight, reason: str) -> None:
        record.finish_reason = reason
        self._forget(record)
        record.set_done()

    def fail(self, record: InFlight, error: RolloutError) -> None:
        record.error = error
        self._forget(record)
        record.set_done()

    def _forget(self, record: InFlight) -> None:
        self.records.pop(record.request_id, None)
        self.detach(record)


def completion(record: InFlight, decode: Callable[[list[int]], str]) -> Completion:
    n = len(record.tokens)
    text = decode(record.tokens)
    for stop in record.spec.stop:
        if stop in text:
            text = text[: text.index(stop)]
    first = record.first_token_at or record.submitted_at
    last = record.last_token_at or first
    return Completion(
        request_id=record.request_id,
        prompt_len=len(record.prompt_ids),
        token_ids=list(record.tokens),
        text=text,
        finish_reason=record.finish_reason or "stop",
        prefill_s=first - record.submitted_at,
        decode_s_per_token=(last - first) / (n - 1) if n > 1 else 0.0,
        recoveries=tuple(record.recoveries),
        logprobs=list(record.logprobs[:n]),
        versions=list(record.versions[:n]),
        recovered_at=tuple(record.recovered_at),
    )


def new_record(prompt_ids, spec, request_id, on_progress) -> InFlight:
    return InFlight(request_id, list(prompt_ids), spec, time.monotonic(), on_progress=on_progress)
