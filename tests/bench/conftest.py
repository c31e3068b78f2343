"""The in-process trajectory stack of tests/workflows (scripted engine, real Temporal,
SeaweedFS and podman + CRIU sandboxes), shared with the benchmark tests."""

from tests.sandbox.conftest import sandbox_runtime  # noqa: F401  (fixture)
from tests.workflows.conftest import stack, tokenizer_path  # noqa: F401  (fixtures)
