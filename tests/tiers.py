"""Test tiers, assigned from the fixtures a test uses, so a marker cannot drift from what runs.

A fixture that starts (or needs) something expensive declares it with `@needs(...)`; a test
is marked with every resource of every fixture it uses, directly or through other fixtures,
and with `pure` when it uses none. The tiers, cheapest first:

* `pure`: no process at all;
* `stack`: processes of the test's own, typically Temporal and SeaweedFS (the scripted engine
  runs in-process);
* `engine`: vLLM, on the model the project builds;
* `sandbox`: podman + CRIU and the base image;
* `whole`: the whole stack (`belayer up`) or a benchmark run.

`make test-fast` runs `pure` and `stack`; `make test` runs every tier.

Markers written by hand for these tiers are refused at collection, and `ProcessGuard` fails
a test that starts a process its tier does not declare (a `pure` test that runs a server, a
`stack` test that runs podman), naming the fixture that declares it. So a test cannot land
in the fast tier while it starts an engine, whatever its file says.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
from collections.abc import Callable, Iterable

TIERS = ("pure", "stack", "engine", "sandbox", "whole")
RESOURCES = TIERS[1:]
# What each resource implies: the whole stack runs every service, and engines and sandboxes
# are processes too.
_IMPLIES = {"stack": {"stack"}, "engine": {"stack", "engine"}, "sandbox": {"stack", "sandbox"},
            "whole": set(RESOURCES)}  # fmt: skip
# The fixture a test uses to declare each resource when it starts it itself.
DECLARING_FIXTURE = {"stack": "local_processes", "engine": "tiny_model", "sandbox": "sandbox_runtime",
                     "whole": "whole_system"}  # fmt: skip

_SHELLS = {"sh", "bash", "dash"}
_SANDBOX_PROGRAMS = {"podman", "criu", "runc", "crun", "conmon"}
# What podman does that makes or moves containers and images; the rest (`ps`, `image inspect`,
# `version`) only asks, as `belayer status` does.
_PODMAN_ACTIONS = {"run", "create", "start", "restart", "exec", "checkpoint", "restore", "build", "load",
                   "import", "pull", "container"}  # fmt: skip
_SANDBOX_WORKER, _ROLLOUT_WORKER = "belayer.workers.sandbox", "belayer.workers.rollout"
# Asking a program its version or whether the kernel supports it starts nothing of its kind.
_PROBES = (["--version"], ["check"])
# Programs that only read what the machine has: matplotlib lists the fonts (`fc-list`) the
# first time it is imported, wherever that is; ctypes' find_library reads the linker cache
# (`ldconfig -p`) for torch's TensorBoard writer.
_QUERIES = {"fc-list", "ldconfig"}


def needs(*resources: str) -> Callable:
    """Declare on a fixture function the resources it starts or needs (see the module docstring)."""
    unknown = set(resources) - set(RESOURCES)
    if unknown:
        raise ValueError(f"unknown test resources {sorted(unknown)}; known: {RESOURCES}")

    def declare(function: Callable) -> Callable:
        function.belayer_test_resources = frozenset().union(*(_IMPLIES[r] for r in resources))
        return function

    return declare


def resources_of(fixture_functions: Iterable[Callable]) -> frozenset[str]:
    """The resources the given fixture functions declare, together."""
    return frozenset().union(*(getattr(f, "belayer_test_resources", frozenset()) for f in fixture_functions))


def resources_of_command(args) -> frozenset[str]:
    """The resources a command line starts: what the process guard compares with a test's tier."""
    words = _words(args)
    line = " ".join(words)
    up = _belayer_up_components(words)
    if up is not None:
        return up
    program = os.path.basename(words[0]) if words else ""
    if words[1:] in _PROBES:
        return frozenset({"stack"})
    if program in _QUERIES:
        return frozenset()
    if program == "podman" and not _PODMAN_ACTIONS & set(words[1:]):
        return frozenset({"stack"})
    if program in _SANDBOX_PROGRAMS or _SANDBOX_WORKER in words or "infra/install/" in line:
        return frozenset({"stack", "sandbox"})
    if (
        program == "vllm"
        or _ROLLOUT_WORKER in words
        or any(w == "vllm" or w.startswith("vllm.") for w in words)
    ):
        return frozenset({"stack", "engine"})
    return frozenset({"stack"})


def _words(args) -> list[str]:
    """The words of a command line: a shell string (`shell=True`) or a shell's `-c` script is
    split as the shell would, so `"podman run ..."` is classified like `["podman", "run", ...]`."""
    if isinstance(args, str | bytes):
        return _split(os.fsdecode(args))
    words = [os.fsdecode(a) for a in ([args] if isinstance(args, os.PathLike) else args)]
    if len(words) >= 3 and os.path.basename(words[0]) in _SHELLS and words[1] == "-c":
        return _split(words[2])  # what the shell runs is what starts
    return words


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:  # an unbalanced quote: the shell would refuse it too; classify the words
        return line.split()


def _belayer_up_components(words: list[str]) -> frozenset[str] | None:
    """For `belayer up [--only A,B]` the resources of what it starts (everything without
    `--only`); None for any other command."""
    for i, word in enumerate(words[:-1]):
        if os.path.basename(word) == "belayer" and words[i + 1] == "up":
            rest = words[i + 2 :]
            if "--only" not in rest or rest.index("--only") + 1 >= len(rest):
                return frozenset(RESOURCES)
            components = rest[rest.index("--only") + 1].split(",")
            found = {"stack"}
            found |= {"engine"} if any(c.startswith("rollout-node") for c in components) else set()
            found |= {"sandbox"} if "sandbox-worker" in components else set()
            return frozenset(found)
    return None


class ProcessGuard:
    """While installed, a process started from the test's own thread whose resource the test
    does not declare raises, naming the fixture to use. Processes started by other threads
    (a session fixture's restart loop, a node left from an earlier test of the module) are
    not the test's doing and are left alone."""

    def __init__(self, test: str, resources: frozenset[str]):
        self.test = test
        self.resources = resources
        self.thread = threading.get_ident()
        self._original = subprocess.Popen._execute_child

    def install(self) -> None:
        guard = self

        def execute_child(popen, args, *rest, **kwargs):
            guard.check(args)
            return guard._original(popen, args, *rest, **kwargs)

        subprocess.Popen._execute_child = execute_child

    def uninstall(self) -> None:
        subprocess.Popen._execute_child = self._original

    def check(self, args) -> None:
        if threading.get_ident() != self.thread:
            return
        missing = sorted(resources_of_command(args) - self.resources, key=RESOURCES.index)
        if missing:
            tier = ", ".join(sorted(self.resources)) or "pure"
            fixtures = ", ".join(repr(DECLARING_FIXTURE[r]) for r in missing)
            raise TierViolation(
                f"{self.test} (tier: {tier}) started {_shown(args)!r}, which needs the {missing} tier: "
                f"use the fixture {fixtures} (tests/tiers.py)"
            )


class TierViolation(AssertionError):
    """A test started a process of a tier it does not declare."""


def _shown(args) -> str:
    words = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
    return " ".join(os.fsdecode(w) for w in words)[:200]
