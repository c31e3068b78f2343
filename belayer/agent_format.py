"""The agent's text format: the prompt it reads, its observations, the tool call it writes.

The model calls the sandbox with `<bash>COMMAND</bash>` and reads each observation
between `<observation>` marks. One module for both sides, so that the model builder
(which trains and evaluates on this format) and the trajectory workflow (which parses
what the model wrote) cannot drift apart. Pure code, safe inside a workflow: no Temporal,
no I/O; a malformed call is a policy outcome (an observation that says what was wrong),
never an exception.
"""

from __future__ import annotations

import json
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


def render_chat(messages: list[dict]) -> str:
    """An OpenAI chat conversation in this format, the chat template of the models Belayer
    builds (`belayer serve`): the first user message is the task in the prompt, an
    assistant message is its text (a structured tool call with a `command` argument is
    written as the `<bash>` call it stands for), a tool message is an observation, later
    user and system messages follow as plain lines. A model turn and the observation after
    it render exactly as a trajectory's token log holds them, so an agent that sends back
    what it was given extends its session's context."""
    parts: list[str] = []
    prompted = False
    for message in messages:
        role, text = message.get("role"), _message_text(message)
        if role == "user" and not prompted:
            parts.append(PROMPT_TEMPLATE.format(instruction=text))
            prompted = True
        elif role == "assistant":
            parts.append(text + "".join(f"<bash>{c}</bash>" for c in _tool_commands(message)))
        elif role == "tool":
            parts.append(OBSERVATION_TEMPLATE.format(body=text))
        elif role in ("user", "system", "developer"):
            parts.append(f"{text}\n")
        else:
            raise ValueError(f"message role {role!r} is not one of system, developer, user, assistant, tool")
    return "".join(parts)


def _message_text(message: dict) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _tool_commands(message: dict) -> list[str]:
    """The commands of an assistant message's structured tool calls (`{"command": ...}` arguments)."""
    commands = []
    for call in message.get("tool_calls") or []:
        arguments = (call.get("function") or {}).get("arguments") or "{}"
        try:
            command = json.loads(arguments).get("command")
        except (ValueError, AttributeError):
            command = None
        if not command:
            raise ValueError("a tool call's arguments must be JSON with a `command` string")
        commands.append(command)
    return commands
