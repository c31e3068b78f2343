"""Harbor task directories made ready to run, the parts that need no stack: the tars of
tests and solutions (their bytes, hence their keys, depend only on the files), what is
refused before any image is built, and the healthcheck as a setup command."""

from __future__ import annotations

import io
import tarfile

import pytest

from belayer.workloads.harbor import HarborTaskError, HealthcheckConfig
from belayer.workloads.harbor_tasks import healthcheck_command, load_harbor_tasks, pack


def members(data: bytes) -> dict[str, tuple[int, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: (m.mode, tar.extractfile(m).read()) for m in tar}


def test_a_pack_depends_only_on_names_contents_and_executable_bits(tmp_path):
    shared, own = tmp_path / "shared", tmp_path / "own"
    (shared / "lib").mkdir(parents=True)
    own.mkdir()
    (shared / "test.sh").write_text("shared\n")
    (shared / "lib" / "helper.py").write_text("x = 1\n")
    (own / "test.sh").write_text("own\n")
    (own / "test.sh").chmod(0o755)
    packed = pack([shared, own])
    assert members(packed) == {"lib/helper.py": (0o644, b"x = 1\n"), "test.sh": (0o755, b"own\n")}
    (shared / "lib" / "helper.py").touch()  # a new mtime changes nothing
    assert pack([shared, own]) == packed
    (shared / "link").symlink_to("/etc/passwd")
    with pytest.raises(HarborTaskError, match="a symbolic link; tests and solutions must be plain files"):
        pack([shared])


def write_task(root, name: str, toml: str):
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm\n")
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (task / "instruction.md").write_text("do it\n")
    (task / "task.toml").write_text(toml)
    return task


def test_strict_network_refuses_a_task_that_asks_for_network_before_building_anything(tmp_path):
    task = write_task(tmp_path, "online", "")  # allow_internet defaults to true, as in Harbor
    with pytest.raises(HarborTaskError, match="asks for network .* --strict-network refuses it"):
        load_harbor_tasks(task, store=None, builder=None, strict_network=True)


def test_the_oracle_needs_a_solution_for_every_step(tmp_path):
    task = write_task(tmp_path / "set", "no-solution", "[environment]\nallow_internet = false\n")
    with pytest.raises(HarborTaskError, match=r"has no solution/ for --agent oracle"):
        load_harbor_tasks(task, store=None, builder=None, agent="oracle")
    steps = write_task(
        tmp_path / "multi", "steps", '[environment]\nallow_internet = false\n[[steps]]\nname = "one"\n'
    )
    (steps / "steps" / "one" / "tests").mkdir(parents=True)
    (steps / "steps" / "one" / "instruction.md").write_text("step one\n")
    (steps / "steps" / "one" / "tests" / "test.sh").write_text("true\n")
    with pytest.raises(HarborTaskError, match=r"has no steps/one/solution/ for --agent oracle"):
        load_harbor_tasks(steps, store=None, builder=None, agent="oracle")


def test_a_healthcheck_is_retried_until_it_passes_before_the_agent_starts():
    command = healthcheck_command(
        HealthcheckConfig(command="curl -f localhost:8000", retries=2, interval_sec=1)
    )
    assert command.startswith(
        "sleep 0; for __try in $(seq 2); do timeout 30 bash -c 'curl -f localhost:8000'"
    )
    assert command.endswith("exit 1")
