from belayer.agent_format import malformed_observation, parse_action


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
