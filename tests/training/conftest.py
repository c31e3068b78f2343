"""The modules here run on the session's shared whole stack (tests/conftest.py): `belayer up`
with Temporal, SeaweedFS, podman sandboxes, a real vLLM rollout node on the warm-started
tiny model and the real torch trainer worker."""

from __future__ import annotations

import pytest

from tests.conftest import WHOLE_STACK_MODEL

MODEL = WHOLE_STACK_MODEL


@pytest.fixture(scope="session")
def stack(one_host_stack):
    """(config, env) of the shared whole stack."""
    return one_host_stack
