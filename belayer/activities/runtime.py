"""`implements(contract)`: an activity implementation registered under its contract.

The one place where an activity's arguments are read: the worker hands the method the
raw payload, which the contract reads (fields the worker does not know dropped, see
belayer/contracts/activity.py). A payload the worker cannot read fails the activity
non-retryably (`UNREADABLE_PAYLOAD`), with a message naming the contract version that
wrote it and the one this worker reads: retrying on the same worker could never
succeed, and an older worker must not burn a newer workflow's retries on it.

Its result goes back stamped with the worker's contract version, as the arguments came
(belayer/contracts/activity.py), so a workflow worker that cannot read it names both
versions too. A method called directly (tests, a rollout node appending in-process)
takes and returns the models as they are, and so does an activity without arguments
(its result is read as version 1).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

from belayer.contracts.activity import Activity, UnreadablePayload, stamped
from belayer.contracts.errors import UNREADABLE_PAYLOAD

Method = Callable[..., Awaitable[Any]]


def implements(contract: Activity) -> Callable[[Method], Method]:
    """Register the decorated method (`async def name(self, args)`, or `(self)` for a
    contract without arguments) as the activity `contract.name`."""

    def decorate(method: Method) -> Method:
        if contract.args is None:

            async def run(self):
                return await method(self)

            run.__annotations__ = {"return": contract.result}
        else:

            async def run(self, args):
                if not isinstance(args, RawValue):
                    return await method(self, args)  # called directly, with the model
                result = await method(self, _read_args(contract, args.payload))
                return RawValue(stamped(activity.payload_converter().to_payload(result)))

            # What the worker decodes the argument to: the payload itself, read above.
            run.__annotations__ = {"args": RawValue, "return": contract.result}
        run.__name__, run.__qualname__, run.__doc__ = method.__name__, method.__qualname__, method.__doc__
        run.__module__ = method.__module__
        return activity.defn(name=contract.name)(run)

    return decorate


def _read_args(contract: Activity, payload: Payload) -> Any:
    try:
        return contract.read_args(payload, activity.payload_converter())
    except UnreadablePayload as exc:
        raise ApplicationError(str(exc), type=UNREADABLE_PAYLOAD, non_retryable=True) from exc
