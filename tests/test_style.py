"""The tree is formatted and linted by the tools the ecosystem uses, so style is never a
review topic: `ruff format` and `ruff check` (settings in pyproject.toml) over the package,
the tests and the examples. The fast tier runs it (`make test-fast`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = [sys.executable, "-m", "ruff"]
CHECKED = ["belayer", "tests", "examples", "infra"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RUFF, *args, *CHECKED], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.usefixtures("local_processes")
def test_the_tree_is_formatted():
    done = ruff("format", "--check")
    assert done.returncode == 0, f"run `.venv/bin/ruff format` to format these:\n{done.stdout}{done.stderr}"


@pytest.mark.usefixtures("local_processes")
def test_the_tree_passes_the_linter():
    done = ruff("check")
    assert done.returncode == 0, (
        f"`.venv/bin/ruff check --fix` fixes most of these:\n{done.stdout}{done.stderr}"
    )
