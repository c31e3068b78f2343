"""The test tiers: markers follow the fixtures a test uses, and a test that starts a process of
a tier it does not declare fails before the process exists."""

from __future__ import annotations

import subprocess

import pytest

from tests.tiers import ProcessGuard, TierViolation, needs, resources_of_command


def tiers_of(node) -> set[str]:
    return {m.name for m in node.iter_markers()} & {"pure", "stack", "engine", "sandbox", "whole"}


def test_a_test_that_uses_no_resource_fixture_is_pure(request):
    assert tiers_of(request.node) == {"pure"}


def test_a_test_on_the_object_store_is_in_the_stack_tier(storage_config, request):
    """`storage_config` needs `seaweedfs`, which declares `stack`: fixtures count transitively."""
    assert tiers_of(request.node) == {"stack"}


@pytest.mark.usefixtures("whole_system")
def test_the_whole_system_implies_every_resource(request):
    assert tiers_of(request.node) == {"stack", "engine", "sandbox", "whole"}


@pytest.mark.parametrize(
    ("command", "resources"),
    [
        (["git", "rev-parse", "HEAD"], {"stack"}),
        (["podman", "--root", "/r", "run", "--rm", "img", "true"], {"stack", "sandbox"}),
        (["podman", "--root", "/r", "image", "inspect", "img"], {"stack"}),
        (["podman", "--version"], {"stack"}),
        (["/cache/bin/criu", "check"], {"stack"}),
        (["/cache/bin/criu", "dump", "-t", "1"], {"stack", "sandbox"}),
        (["bash", "infra/install/base-image.sh"], {"stack", "sandbox"}),
        (["python", "-m", "belayer.workers.rollout"], {"stack", "engine"}),
        (["python", "-m", "belayer.workers.sandbox"], {"stack", "sandbox"}),
        (["python", "-m", "vllm.entrypoints.openai.api_server"], {"stack", "engine"}),
        (["python", "-c", "from belayer.workers.rollout.identity import claim"], {"stack"}),
        (["/venv/bin/belayer", "up"], {"stack", "engine", "sandbox", "whole"}),
        (["/venv/bin/belayer", "up", "--only", "temporal,seaweedfs"], {"stack"}),
        (["/venv/bin/belayer", "up", "--only", "seaweedfs,rollout-node.1"], {"stack", "engine"}),
        ("podman ps", {"stack"}),
        ("podman --root /r run --rm img true", {"stack", "sandbox"}),
        (b"/cache/bin/criu dump -t 1", {"stack", "sandbox"}),
        (["bash", "-c", "podman run --rm img true && echo done"], {"stack", "sandbox"}),
        (["sh", "-c", "echo 'unbalanced"], {"stack"}),
    ],
)
def test_a_command_line_is_classified_by_what_it_starts(command, resources):
    assert resources_of_command(command) == resources


def test_a_process_outside_the_declared_tier_is_refused_before_it_starts(tmp_path):
    marker = tmp_path / "ran"
    guard = ProcessGuard("a pure test", frozenset())
    guard.install()
    try:
        with pytest.raises(TierViolation, match="local_processes"):
            subprocess.run(["touch", str(marker)], check=True)
    finally:
        guard.uninstall()
    assert not marker.exists()


@pytest.mark.usefixtures("local_processes")
def test_a_stack_test_runs_its_processes_but_no_container():
    guard = ProcessGuard("a stack test", frozenset({"stack"}))
    guard.install()
    try:
        assert subprocess.run(["true"], check=False).returncode == 0
        with pytest.raises(TierViolation, match="sandbox_runtime"):
            subprocess.run(["podman", "run", "--rm", "img", "true"], check=False)
    finally:
        guard.uninstall()


def test_needs_refuses_an_unknown_resource():
    with pytest.raises(ValueError, match="unknown test resources"):
        needs("gpu")
