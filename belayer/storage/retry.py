"""The storage layer's only retry loop: exponential backoff with jitter.

Only `TransientStorageError` is retried, at most `max_attempts` times in all; every
other error goes straight to the caller. botocore's own retries are off
(`s3client.py`), so a request is never retried twice over.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from belayer.storage.errors import StorageError, TransientStorageError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class RetryPolicy:
    """How often and how patiently a transient failure is retried."""

    max_attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, attempt: int) -> float:
        """Equal jitter after failed `attempt` (1-based): cap/2 + uniform(0, cap/2), where
        cap = min(max_delay_s, base_delay_s * 2**(attempt-1)).

        Half the delay is fixed so that the total patience has a floor (at the defaults,
        8 attempts wait 8-16 s, longer than a SeaweedFS restart); the other half spreads
        out clients that failed together.
        """
        cap = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return cap / 2 + self.rng.uniform(0.0, cap / 2)

    def call(
        self, fn: Callable[[], T], *, translate: Callable[[BaseException], StorageError], what: str
    ) -> T:
        """`fn()`, retried on transient errors; raises the translated error of the last attempt."""
        attempt = 1
        while True:
            try:
                return fn()
            except StorageError:
                raise  # already ours, and already retried where it was raised
            except Exception as exc:  # translated right here; nothing is swallowed
                error = translate(exc)
                if not isinstance(error, TransientStorageError) or attempt >= self.max_attempts:
                    if isinstance(error, TransientStorageError) and self.max_attempts > 1:
                        error = TransientStorageError(
                            f"{error} (gave up after {attempt} attempts)", code=error.code
                        )
                    raise error from exc
                pause = self.delay(attempt)
                log.info(
                    "%s: transient error, attempt %d/%d, retrying in %.2fs: %s",
                    what,
                    attempt,
                    self.max_attempts,
                    pause,
                    error,
                )
                self.sleep(pause)
                attempt += 1
