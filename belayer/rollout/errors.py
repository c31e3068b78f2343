"""Errors of the rollout node: what a caller may retry and what it must not."""

from belayer.errors import BelayerError


class RolloutError(BelayerError):
    """The rollout node failed; `retryable` says whether another attempt may succeed."""

    retryable = True


class BadRequestError(RolloutError):
    """The request itself is invalid (token outside the vocabulary, prompt too long, prefix
    hash mismatch): retrying it anywhere gives the same answer."""

    retryable = False


class NodeClosedError(RolloutError):
    """The node was shut down while the request was in flight; another node may serve it."""


class EngineStartError(RolloutError):
    """An engine or the memory owner did not become ready; the message names the setting."""


class SharedMemoryError(RolloutError):
    """A shared-memory segment is missing, too small, or its header is not intact."""


class NodeFull(RolloutError):
    """The node already serves as many sequences, or holds as many KV tokens, as it
    declared (`rollout.max_num_seqs`, `rollout.kv_cache_mb`): refused at once rather than
    queued inside the engine, so another node, or a later attempt, serves the turn."""
