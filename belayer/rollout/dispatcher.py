"""Requests into a node and tokens out: validation, the leader's share of the in-flight
log, token deltas, stop strings.

Every request goes through the in-flight log, and the one path to an engine is
`Dispatcher.send_unsent`: a new submission, a replay after a recovery and a re-send after
a publish are the same act (send what the leader does not have, if it computes with the
version the request is pinned to), so none of them can diverge from the others.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from belayer.rollout import children
from belayer.rollout.errors import BadRequestError, NodeClosedError, NodeFull, RolloutError
from belayer.rollout.inflight import Completion, InFlight, completion, new_record
from belayer.rollout.protocol import AbortRequest, Rejected, SamplingSpec, StepOutput

if TYPE_CHECKING:
    from belayer.rollout.node import RolloutNode

log = logging.getLogger("belayer.rollout")


class RequestHandle:
    """A submitted request: wait for its `Completion`, or look at its progress."""

    def __init__(self, dispatcher: Dispatcher, record: InFlight):
        self._dispatcher, self._record = dispatcher, record

    @property
    def request_id(self) -> str:
        return self._record.request_id

    # Lock-free on purpose: heartbeats must never wait for the node. The lists only grow
    # (loop thread, logprobs and versions before tokens) and copying one is atomic under
    # the GIL, so each is a consistent prefix of the request's output.
    def tokens_so_far(self) -> list[int]:
        return list(self._record.tokens)

    def logprobs_so_far(self) -> list[float]:
        return list(self._record.logprobs)

    def versions_so_far(self) -> list[int]:
        return list(self._record.versions)

    def done(self) -> bool:
        return self._record.done.is_set()

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` from the node's thread when the request ends (now if it has)."""
        self._record.when_done(callback)

    def result(self, timeout: float | None = None) -> Completion:
        if not self._record.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self._record.error is not None:
            raise self._record.error
        return completion(self._record, self._dispatcher.decode)


class Dispatcher:
    """Routes requests to the leader and its tokens back to them."""

    def __init__(self, node: RolloutNode):
        self._node = node
        self._tokenizer: Tokenizer | None = None
        self._listeners: list[Callable[[str, int], None]] = []

    def submit(
        self,
        prompt_ids: list[int],
        spec: SamplingSpec,
        request_id: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> RequestHandle:
        """Validate and log one request; the loop sends it to the leader. Bad input raises
        `BadRequestError` (non-retryable) and leaves the node serving."""
        node = self._node
        self._validate(prompt_ids, spec)
        if node.closed:
            raise NodeClosedError(f"rollout node {node.config.node_id} is closed")
        if node.broken is not None:
            raise RolloutError(
                f"rollout node {node.config.node_id} cannot serve ({node.broken}); retry elsewhere"
            )
        record = new_record(prompt_ids, spec, request_id or uuid.uuid4().hex, on_progress)
        with node.lock:
            if node.inflight.get(record.request_id) is not None:
                raise BadRequestError(f"request id {record.request_id} is already in flight")
            self._admit(record)
            node.inflight.add(record)
            log.debug("request %s: %d prompt tokens, %s", record.request_id, len(record.prompt_ids), spec)
        node.wake()
        return RequestHandle(self, record)

    def _admit(self, record: InFlight) -> None:
        """Refuse the request at once (`NodeFull`) when the node serves its capacity already
        (belayer/rollout/admission.py); the node's lock is held."""
        node = self._node
        refusal = node.capacity.refusal(
            [len(r.prompt_ids) + len(r.tokens) for r in node.inflight.open()], len(record.prompt_ids)
        )
        if refusal is not None:
            node.refused += 1
            raise NodeFull(
                f"rollout node {node.config.node_id} refuses request {record.request_id}: {refusal}"
            )

    def cancel(self, request_id: str, why: str = "cancelled by the caller") -> None:
        """Drop a request (e.g. its activity was cancelled): the leader stops decoding it."""
        node = self._node
        with node.lock:
            record = node.inflight.get(request_id)
            if record is None:
                return
            engine_id = record.engine_request_id
            node.inflight.fail(record, NodeClosedError(f"request {request_id}: {why}"))
        if engine_id is not None:
            node.in_loop(lambda: children.send(node.holders.leader, AbortRequest(engine_id)))

    def _validate(self, prompt_ids: list[int], spec: SamplingSpec) -> None:
        config, vocab_size = self._node.config, self._node.vocab_size
        if not prompt_ids:
            raise BadRequestError("empty prompt: a request needs at least one token")
        bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
        if bad:
            raise BadRequestError(
                f"token id {bad[0]} is outside the model's vocabulary [0, {vocab_size}); "
                "the prefix was tokenized for a different model"
            )
        if len(prompt_ids) >= config.max_model_len:
            raise BadRequestError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {config.max_model_len} "
                "tokens (rollout.max_model_len); shorten the trajectory or raise the setting"
            )
        if spec.max_tokens < 1:
            raise BadRequestError(f"max_tokens must be >= 1, got {spec.max_tokens}")
        if spec.temperature < 0 or not 0 < spec.top_p <= 1 or spec.top_k < 0:
            raise BadRequestError(f"invalid sampling parameters: {spec}")

    def send_unsent(self) -> None:
        """Send every logged request the leader does not have yet, if it may serve it: the
        one path for new submissions, replays after a recovery and re-sends after a publish."""
        node = self._node
        leader = node.holders.leader
        if leader is None or leader.ready is None or leader.switching_to is not None:
            return
        with node.lock:
            for record in node.inflight.unsent():
                if (record.pinned_version or node.target_version) != leader.version:
                    continue  # waits for the leader to be on its version
                request = node.inflight.request_for(record, node.config.max_model_len)
                if request is not None:
                    node.hang.sent(request.engine_request_id, len(request.prompt_ids))
                    children.send(leader, request)

    def on_step(self, msg: StepOutput) -> None:
        """(node lock held) The leader's tokens of one step, to their requests."""
        node = self._node
        now = time.monotonic()
        for delta in msg.deltas:
            record = node.inflight.on_engine(delta.engine_request_id)
            if record is None or record.done.is_set():
                continue  # a stale engine id (replayed elsewhere) or already finished
            if delta.token_ids:
                record.first_token_at = record.first_token_at or now
                record.last_token_at = now
                record.record(delta, msg.weights_version)
                if record.on_progress is not None:
                    record.on_progress(len(record.tokens))
                for listener in self._listeners:
                    listener(record.request_id, len(record.tokens))
            if record.spec.stop and self._hit_stop(record):
                children.send(node.holders.leader, AbortRequest(delta.engine_request_id))
                node.inflight.finish(record, "stop")
            elif delta.finished:
                node.inflight.finish(record, delta.finish_reason or "stop")

    def on_rejected(self, msg: Rejected) -> None:
        """(node lock held) The engine refused a request: it fails, not retryable."""
        node = self._node
        record = node.inflight.on_engine(msg.engine_request_id)
        if record is not None:
            node.inflight.fail(
                record, BadRequestError(f"engine rejected request {record.request_id}: {msg.message}")
            )

    def _hit_stop(self, record: InFlight) -> bool:
        text = self.decode(record.tokens)
        return any(s in text for s in record.spec.stop)

    def decode(self, tokens: list[int]) -> str:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_file(str(self._node.model_dir / "tokenizer.json"))
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def add_progress_listener(self, listener: Callable[[str, int], None]) -> None:
        """Call `listener(request_id, tokens_so_far)` on the loop thread after every delta
        (benchmarks and fault injection: act at an exact point of progress)."""
        with self._node.lock:
            self._listeners.append(listener)

    def remove_progress_listener(self, listener: Callable[[str, int], None]) -> None:
        with self._node.lock:
            self._listeners.remove(listener)
