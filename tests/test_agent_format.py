import pytest

from belayer.agent_format import (
    OBSERVATION_TEMPLATE,
    PROMPT_TEMPLATE,
    malformed_observation,
    parse_action,
    render_chat,
)


def test_first_call_is_taken():
    action = parse_action("I will list.\n<bash> ls -la </bash> then <bash>rm -rf /</bash>")
    assert action.kind == "bash" and action.command == "ls -la"


def test_multiline_command():
    assert parse_action("<bash>cd /w\necho hi</bash>").command == "cd /w\necho hi"


def test_no_call_means_stop():
    assert parse_action("All done.").kind == "stop"


def test_malformed_calls_are_observations_not_errors():
    unclosed = parse_action("<bash>ls")
    empty = parse_action("<bash>  </bash>")
    assert unclosed.kind == empty.kind == "malformed"
    assert "closing </bash>" in malformed_observation(unclosed)
    assert "empty" in malformed_observation(empty)


def test_a_chat_renders_as_a_trajectorys_context_does():
    """The chat template of the project's models: the first user message is the task in
    the prompt, a turn is its text, a tool message an observation, so an agent that sends
    back what it was given extends its session's token log."""
    messages = [
        {"role": "user", "content": "Write 4 to /tmp/x."},
        {"role": "assistant", "content": "<bash>echo 4 > /tmp/x</bash>"},
        {"role": "tool", "content": "[exit 0]"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"arguments": '{"command": "cat /tmp/x"}'}}],
        },
        {"role": "tool", "content": [{"type": "text", "text": "4\n[exit 0]"}]},
    ]
    assert render_chat(messages) == (
        PROMPT_TEMPLATE.format(instruction="Write 4 to /tmp/x.")
        + "<bash>echo 4 > /tmp/x</bash>"
        + OBSERVATION_TEMPLATE.format(body="[exit 0]")
        + "<bash>cat /tmp/x</bash>"
        + OBSERVATION_TEMPLATE.format(body="4\n[exit 0]")
    )
    with pytest.raises(ValueError, match="role 'robot'"):
        render_chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="`command` string"):
        render_chat([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}])
