"""The `belayer` command registers every command it documents, and a command whose code
cannot be imported stops the CLI with the import error instead of silently vanishing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from belayer.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"
# `belayer up --only ...` in backticks, or a line of a shell block (`.venv/bin/belayer run ...`).
_WORD = r"[a-z][a-z-]*(?![\w/.])"  # a command name, not a path such as examples/x.yaml
_INVOCATION = re.compile(rf"(?:`|^\s*(?:\S*/)?)belayer ({_WORD}(?: {_WORD})*)", re.MULTILINE)


def documented_commands() -> set[tuple[str, ...]]:
    """Every command path the README shows an invocation of, e.g. ("bench", "fork")."""
    paths = set()
    for words in _INVOCATION.findall(README.read_text()):
        path: list[str] = []
        command: click.Command = main
        for word in words.split():
            if not isinstance(command, click.Group):
                break  # the rest are the command's arguments
            try:  # as the group resolves it (`belayer chaos FAULT` is `belayer chaos inject FAULT`)
                name, command, _ = command.resolve_command(click.Context(command), [word])
            except click.UsageError:
                path.append(word)
                break
            path.append(name)
        paths.add(tuple(path))
    return paths


def test_the_readme_documents_commands():
    assert {("up",), ("run",), ("bench", "fork"), ("model", "export")} <= documented_commands()


@pytest.mark.parametrize("path", sorted(documented_commands()), ids=" ".join)
def test_every_documented_command_is_in_the_help(path):
    group: click.Command = main
    for name in path:
        assert isinstance(group, click.Group), f"`belayer {' '.join(path)}`: {group.name} takes no subcommand"
        group = group.commands.get(name)
        assert group is not None and not group.hidden, (
            f"the README documents `belayer {' '.join(path)}`, which `belayer --help` does not list"
        )


def test_belayer_chaos_takes_a_fault_or_a_command():
    """`belayer chaos FAULT` injects one fault as it always did; `belayer chaos soak` is the soak."""
    from click.testing import CliRunner

    runner = CliRunner()
    fault = runner.invoke(main, ["chaos", "node-crash", "--help"])
    assert fault.exit_code == 0 and "Usage: main chaos inject" in fault.output and "--node" in fault.output
    soak = runner.invoke(main, ["chaos", "soak", "--help"])
    assert soak.exit_code == 0 and "--group-size" in soak.output and "terminate" in soak.output
    unknown = runner.invoke(main, ["chaos", "meteor-strike"])
    assert unknown.exit_code == 2 and "'meteor-strike' is not one of" in unknown.output


@pytest.mark.usefixtures("local_processes")
@pytest.mark.parametrize("module", ["belayer.bench.storage", "belayer.chaos.faults"])
def test_a_command_that_cannot_be_imported_is_an_error_not_a_missing_command(module):
    """A module a command is built on that fails to import (renamed, or a missing
    dependency) makes every `belayer` invocation fail naming it; it never drops the
    command from the CLI while the rest carries on."""
    program = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from belayer.cli.main import main\n"
        "main(['bench', '--help'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60
    )
    assert done.returncode != 0, f"the CLI ran without {module}:\n{done.stdout}"
    assert "ModuleNotFoundError" in done.stderr and module in done.stderr, done.stderr
