"""Turning a model's output into an action: the documented tool-call format.

The model calls the sandbox with `<bash>COMMAND</bash>`. Pure code, used inside the
workflow: a malformed call is a policy outcome (an observation that says what was
wrong), never an exception.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel

_CALL = re.compile(r"<bash>(.*?)</bash>", re.DOTALL)
_OPEN = "<bash>"


class ParsedAction(BaseModel):
    """What the model asked for this turn."""

    kind: Literal["bash", "stop", "malformed"]
    command: str = ""
    problem: str = ""


def parse_action(text: str) -> ParsedAction:
    """The first `<bash>...</bash>` call in `text`; no call at all means the model stopped."""
    match = _CALL.search(text)
    if match:
        command = match.group(1).strip()
        if not command:
            return ParsedAction(kind="malformed", problem="empty <bash></bash> call; put a command inside")
        return ParsedAction(kind="bash", command=command)
    if _OPEN in text:
        return ParsedAction(kind="malformed", problem="<bash> without a closing </bash>; close the call")
    return ParsedAction(kind="stop")


def malformed_observation(action: ParsedAction) -> str:
    """The observation the model sees after a malformed call."""
    return f"error: malformed tool call: {action.problem}. Use <bash>COMMAND</bash>."
