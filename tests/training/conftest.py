"""The whole private stack the modules here share: `belayer up` with Temporal, SeaweedFS,
podman sandboxes, a real vLLM rollout node on the warm-started tiny model and the real
torch trainer worker, started once for the package (it takes a minute and a half)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from belayer.sandbox.runtime import run_podman
from tests.conftest import isolated_config
from tests.test_stack import BELAYER, belayer, cli_env, live_pids_under

ROOT = Path(__file__).parents[2]
MODEL = "tiny-warm"


@pytest.fixture(scope="package")
def stack():
    """A whole private stack. Its state directory is short: podman refuses a run root
    path over 50 characters; the base image is imported into its podman storage from
    the install cache, as `make install` does."""
    state_dir = Path(tempfile.mkdtemp(prefix="blt-", dir="/tmp"))
    config = isolated_config(state_dir)
    env = cli_env(config) | {"BELAYER_ROLLOUT__MODEL": MODEL,
                             "BELAYER_ROLLOUT__NODE_ID": f"t{uuid.uuid4().hex[:6]}"}
    try:
        for step in (["bash", "infra/install/base-image.sh"], [*BELAYER, "up"]):
            done = subprocess.run(step, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=900, cwd=ROOT)
            assert done.returncode == 0, f"{' '.join(step)} failed:\n{done.stdout}\n{done.stderr}"
        yield config, env
    finally:
        belayer(env, "down", check=False)
        leaked = live_pids_under(config.state_dir)
        for pid in leaked:
            psutil.Process(pid).kill()
        run_podman("rmi", "--all", "--force", state_dir=state_dir, timeout=600)
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leaked, f"processes left running under {config.state_dir}: {leaked}"
