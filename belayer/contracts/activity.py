"""`Activity[Args, Result]`: one activity's name and types, and how its payloads are read.

Workflow side, `execute` / `execute_local` schedule the activity with its arguments
stamped with this package's `CONTRACT_VERSION` (in the payload's metadata, beside the
JSON, so the JSON keeps its fields and recorded histories replay) and read the result
leniently. Activity side, `read_args` reads the arguments the same way; the activity
runtime (belayer/activities/runtime.py) turns its `UnreadablePayload` into a
non-retryable failure.

Reading is lenient in one way only: fields the reader does not know are dropped, at any
depth, so a newer writer's additive change (a new field with a default) is read by an
older reader. Everything else fails as it did, now naming the writer's version and the
reader's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import ValidationError
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.converter import PayloadConverter

from belayer.errors import BelayerError

# The version of every contract in this package. Raise it for a change that is not
# additive (see the package's docstring); the payloads a worker sends carry it.
CONTRACT_VERSION = 1
# Payloads from before contracts were versioned carry no version: they are version 1,
# the contracts as they were then.
UNVERSIONED = 1
VERSION_KEY = "belayer-contract-version"

Args = TypeVar("Args")
Result = TypeVar("Result")


class UnreadablePayload(BelayerError):
    """A payload that does not validate against the reader's contract, even with the
    fields it does not know dropped: written by another contract version, or malformed."""

    def __init__(self, what: str, *, written_by: int, reader: int, reason: str):
        newer = " (newer: upgrade this worker)" if written_by > reader else ""
        super().__init__(
            f"cannot read {what}: the payload was written by contract version {written_by}{newer}, "
            f"this worker reads contract version {reader}: {reason}"
        )
        self.written_by = written_by
        self.reader = reader


@dataclass(frozen=True)
class Activity(Generic[Args, Result]):
    """An activity's contract: its name, its argument model (None: it takes none) and its
    result type (None: it returns nothing)."""

    name: str
    args: type[Args] | None
    result: Any

    async def execute(self, args: Args | None = None, **options: Any) -> Result:
        """Run it from workflow code; `options` are `workflow.execute_activity`'s
        (task_queue, timeouts, retry_policy, summary)."""
        raw = await workflow.execute_activity(self.name, args=self._arguments(args), result_type=RawValue,
                                              **options)  # fmt: skip
        return self.read_result(raw.payload, workflow.payload_converter())

    async def execute_local(self, args: Args | None = None, **options: Any) -> Result:
        """Run it as a local activity of the workflow's own worker."""
        raw = await workflow.execute_local_activity(self.name, args=self._arguments(args), result_type=RawValue,
                                                    **options)  # fmt: skip
        return self.read_result(raw.payload, workflow.payload_converter())

    def read_args(self, payload: Payload, converter: PayloadConverter) -> Args:
        return read(payload, self.args, converter, what=f"the arguments of activity {self.name!r}")

    def read_result(self, payload: Payload, converter: PayloadConverter) -> Result:
        return read(payload, self.result, converter, what=f"the result of activity {self.name!r}")

    def _arguments(self, args: Args | None) -> Sequence[RawValue]:
        if self.args is None:
            return []
        return [RawValue(stamped(workflow.payload_converter().to_payload(args)))]


def stamped(payload: Payload, version: int = CONTRACT_VERSION) -> Payload:
    """`payload` marked as written by contract `version`."""
    payload.metadata[VERSION_KEY] = str(version).encode()
    return payload


def version_of(payload: Payload) -> int:
    """The contract version that wrote `payload` (0 when its mark is not a number)."""
    mark = payload.metadata.get(VERSION_KEY)
    if mark is None:
        return UNVERSIONED
    try:
        return int(mark.decode())
    except (UnicodeDecodeError, ValueError):
        return 0


def read(payload: Payload, type_: Any, converter: PayloadConverter, *, what: str) -> Any:
    """`payload` as `type_`, fields unknown to `type_` dropped; `UnreadablePayload` when
    it does not validate even so."""
    try:
        return _decoded(payload, type_, converter)
    except Exception as exc:
        raise UnreadablePayload(what, written_by=version_of(payload), reader=CONTRACT_VERSION,
                                reason=_reason(exc)) from exc  # fmt: skip


def _decoded(payload: Payload, type_: Any, converter: PayloadConverter) -> Any:
    try:
        return converter.from_payload(payload, type_)
    except Exception as exc:
        unknown = _unknown_fields(exc)
        if not unknown:
            raise
    data = json.loads(payload.data)
    for path in unknown:
        _drop(data, path)
    return converter.from_payload(Payload(metadata=payload.metadata, data=json.dumps(data).encode()), type_)


def _unknown_fields(exc: BaseException) -> list[tuple]:
    """Where the validation error under `exc` found fields the model does not have."""
    error = _validation_error(exc)
    return [] if error is None else [e["loc"] for e in error.errors() if e["type"] == "extra_forbidden"]


def _drop(data: Any, path: tuple) -> None:
    """Remove the field at `path` from decoded JSON. A path step that names no key (a
    union member's name, which pydantic puts in the path) is passed over."""
    *parents, field = path
    node = data
    for step in parents:
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and isinstance(step, int) and step < len(node):
            node = node[step]
    if isinstance(node, dict):
        node.pop(field, None)


def _reason(exc: BaseException) -> str:
    """What failed, briefly and without the payload's values (they may be secret): the
    fields the validation error names, or the error itself."""
    error = _validation_error(exc)
    if error is None:
        return f"{type(exc).__name__}: {exc}"[:600]
    fields = [
        f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in error.errors(include_input=False)
    ]
    return "; ".join(fields)[:600]


def _validation_error(exc: BaseException | None) -> ValidationError | None:
    """The pydantic error under a converter's wrapper, if that is what failed."""
    while exc is not None and not isinstance(exc, ValidationError):
        exc = exc.__cause__ or exc.__context__
    return exc
