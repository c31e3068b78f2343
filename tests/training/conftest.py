"""The whole private stack the modules here share: `belayer up` with Temporal, SeaweedFS,
podman sandboxes, a real vLLM rollout node on the warm-started tiny model and the real
torch trainer worker, started once for the package (it takes a minute and a half)."""

from __future__ import annotations

import uuid

import pytest

from tests.test_stack import whole_stack
from tests.tiers import needs

MODEL = "tiny-warm"


@pytest.fixture(scope="package")
@needs("whole")
def stack():
    """A whole private stack, shared by the package's modules."""
    with whole_stack(
        "blt-", {"BELAYER_ROLLOUT__MODEL": MODEL, "BELAYER_ROLLOUT__NODE_ID": f"t{uuid.uuid4().hex[:6]}"}
    ) as started:
        yield started
