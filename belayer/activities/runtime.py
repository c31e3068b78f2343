"""The activity runtime: `implements(contract)` registers an activity under its contract,
`heartbeating` keeps a long activity alive while its work runs, and `to_application_error`
is the one translator from domain errors to the failures workflows react to.

`implements` is the one place where an activity's arguments are read: the worker hands
the method the raw payload, which the contract reads (fields the worker does not know
dropped, see belayer/contracts/activity.py). A payload the worker cannot read fails the
activity non-retryably (`UNREADABLE_PAYLOAD`), with a message naming the contract version
that wrote it and the one this worker reads: retrying on the same worker could never
succeed, and an older worker must not burn a newer workflow's retries on it.

Its result goes back stamped with the worker's contract version, as the arguments came
(belayer/contracts/activity.py), so a workflow worker that cannot read it names both
versions too. A method called directly (tests, a rollout node appending in-process)
takes and returns the models as they are, and so does an activity without arguments
(its result is read as version 1).

An activity given `failures` leaves through `to_application_error` on either path: an
error it names fails it under the type workflows react to (belayer/contracts/errors.py),
never retried; any other domain error that says whether a retry can help (`retryable`)
fails it under its class's name, `non_retryable = not retryable`; the rest is left as
raised, to the activity's retry policy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

from belayer.contracts.activity import Activity, UnreadablePayload, stamped
from belayer.contracts.errors import UNREADABLE_PAYLOAD

Method = Callable[..., Awaitable[Any]]
T = TypeVar("T")


@dataclass(frozen=True)
class FailsAs:
    """An error that fails an activity under `type` (a name of belayer/contracts/errors.py),
    never retried: the input itself is bad, so another attempt would fail the same way.
    `what`, when given, says what was bad ahead of the error's own message."""

    type: str
    what: str = ""

    def error(self, exc: BaseException) -> ApplicationError:
        message = f"{self.what}: {exc}" if self.what else str(exc)
        return ApplicationError(message, type=self.type, non_retryable=True)


@dataclass(frozen=True)
class Failures:
    """How one activity's errors leave it. `named`: errors (and their subclasses) that fail
    it as a `FailsAs` says, looked up in order; `by_retryable`: whether the rest follow
    their own `retryable` (False: left to the retry policy, as the trainer leaves storage
    errors, since a retried step resumes from its checkpoint)."""

    named: Mapping[type[BaseException], FailsAs] = field(default_factory=dict)
    by_retryable: bool = True


BY_RETRYABLE = Failures()


def to_application_error(exc: BaseException, failures: Failures = BY_RETRYABLE) -> BaseException:
    """The one translator: `exc` as the ApplicationError workflows react to, or `exc`
    itself when it is already one or says nothing about retrying. A domain error's
    `details()` (a sandbox host's finding about a lost sandbox) ride along."""
    if isinstance(exc, ApplicationError):
        return exc
    for kind, fails_as in failures.named.items():
        if isinstance(exc, kind):
            return fails_as.error(exc)
    retryable = getattr(exc, "retryable", None)
    if not failures.by_retryable or not isinstance(retryable, bool):
        return exc
    details = exc.details() if callable(getattr(exc, "details", None)) else None
    return ApplicationError(
        str(exc), *([details] if details else []), type=type(exc).__name__, non_retryable=not retryable
    )


async def heartbeating(
    work: Awaitable[T], *, every_s: float, details: Callable[[], Any] | None = None, at_start: bool = False
) -> T:
    """`work`'s result, heartbeating every `every_s` while it runs, so that Temporal tells a
    dead worker from a slow one; `details()` is what each heartbeat carries (none when
    None). The first heartbeat comes after one interval (a short activity sends none, which
    spares each turn an RPC), or at once with `at_start`. The work's end wakes this at once:
    it never waits out an interval."""
    task = asyncio.ensure_future(work)
    try:
        if at_start:
            _beat(details)
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            _beat(details)
    finally:
        task.cancel()  # the activity was cancelled: nobody waits for the work any more


def _beat(details: Callable[[], Any] | None) -> None:
    if details is None:
        activity.heartbeat()
    else:
        activity.heartbeat(details())


def implements(contract: Activity, failures: Failures | None = None) -> Callable[[Method], Method]:
    """Register the decorated method (`async def name(self, args)`, or `(self)` for a
    contract without arguments) as the activity `contract.name`; its errors leave through
    `to_application_error` under `failures` (None: as raised)."""

    def decorate(method: Method) -> Method:
        translated = method if failures is None else _translating(method, failures)
        if contract.args is None:

            async def run(self):
                return await translated(self)

            run.__annotations__ = {"return": contract.result}
        else:

            async def run(self, args):
                if not isinstance(args, RawValue):
                    return await translated(self, args)  # called directly, with the model
                result = await translated(self, _read_args(contract, args.payload))
                return RawValue(stamped(activity.payload_converter().to_payload(result)))

            # What the worker decodes the argument to: the payload itself, read above.
            run.__annotations__ = {"args": RawValue, "return": contract.result}
        run.__name__, run.__qualname__, run.__doc__ = method.__name__, method.__qualname__, method.__doc__
        run.__module__ = method.__module__
        return activity.defn(name=contract.name)(run)

    return decorate


def _translating(method: Method, failures: Failures) -> Method:
    async def translated(*args: Any) -> Any:
        try:
            return await method(*args)
        except Exception as exc:
            error = to_application_error(exc, failures)
            if error is exc:
                raise
            raise error from exc

    return translated


def _read_args(contract: Activity, payload: Payload) -> Any:
    try:
        return contract.read_args(payload, activity.payload_converter())
    except UnreadablePayload as exc:
        raise ApplicationError(str(exc), type=UNREADABLE_PAYLOAD, non_retryable=True) from exc
