"""The agent's text format: the prompt it reads, its observations, the tool call it writes.

The model calls the sandbox with `<bash>COMMAND</bash>` and reads each observation
between `<observation>` marks. One module for both sides, so that the model builder
(which trains and evaluates on this format) and the trajectory workflow (which parses
what the model wrote) cannot drift apart. Pure code, safe inside a workflow: no Temporal,
no I/O; a malformed call is a policy outcome (an observation that says what was wrong),
never an exception.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel

OBSERVATION_TEMPLATE = "\n<observation>\n{body}\n</observation>\n"
PROMPT_TEMPLATE = (
    "You are an agent working in a Linux sandbox. Run a command with <bash>COMMAND</bash>; "
    "answer without a tool call when you are done.\nTask: {instruction}\n"
)

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


def observation_text(observation) -> str:
    """What the model reads of an observation: stdout, stderr, the exit status."""
    parts = [observation.stdout]
    if observation.stderr:
        parts.append(observation.stderr)
    parts.append(f"[exit {observation.exit_code}]")
    return "\n".join(p for p in parts if p)
