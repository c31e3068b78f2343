"""Hostile inputs reuse the real fixtures: sandboxes (tests/sandbox) and the in-process
trajectory stack (tests/workflows); each cleans up what it started and names leaks."""

from tests.sandbox.conftest import sandbox_runtime, sandboxes  # noqa: F401  (fixtures)
from tests.workflows.conftest import stack, tokenizer_path  # noqa: F401  (fixtures)
