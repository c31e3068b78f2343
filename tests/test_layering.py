"""The import layering of `belayer/`, checked from the source text (nothing is imported or started).

Every subpackage and top-level module of `belayer/` (a "part") sits in one layer of
`LAYERS`, bottom first. The rules:

* no part imports a part of a higher layer;
* `FORBIDDEN` names lower parts a layer must not import either (workflows reach the
  sandbox, activities and rollout internals only through the Temporal boundary), single
  modules it must not import (a container engine's backend: everything above the domain
  gets the configured one from the sandbox-backend registry) and the third-party packages
  it must not know (domain code knows nothing of Temporal);
* no import cycle among parts. With no import going up, a cycle can only lie inside one
  layer, so the cycle check looks at the imports between parts of one layer.

Every import counts: at module level, inside functions, under `TYPE_CHECKING`, and a
module that `importlib.import_module` loads by a name spelled in the same file.
What breaks these rules today is listed in `KNOWN_VIOLATIONS`, each with its reason;
the test fails on a violation that is not listed and on a listed one that is gone, so
the list only shrinks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "belayer"

# Bottom first: a part may import parts of its own layer and of the layers below.
LAYERS: dict[str, set[str]] = {
    # What every layer may use: the exception root, the configuration-section base, the
    # registry of fault points, and the seeds derived from a run's seed.
    "base": {"errors", "faults", "section", "seeding"},
    # The system's own work, usable without Temporal or the CLI: object storage, sandboxes,
    # rollout nodes, the trainer, the model builder, the adaptive policy, workloads, the
    # agent's text format.
    "domain": {
        "agent_format",
        "model",
        "policy",
        "rollout",
        "sandbox",
        "storage",
        "trainer",
        "trajectory_log",
        "workloads",
    },
    # One configuration assembled from the domain packages' sections.
    "config": {"config"},
    # Reaching Temporal and the object store: connection, payload encryption, namespace setup.
    "temporal": {"codec_server", "payload_codec", "prepare", "temporal_client"},
    # What workflows and activities agree on: each activity's name, argument and result
    # models, the error types workflows react to, the contract version.
    "contracts": {"contracts"},
    # Deterministic workflow code.
    "workflows": {"workflows"},
    # Temporal activities: the adapters between workflows and the domain.
    "activities": {"activities"},
    # Worker processes: each one's entry point and the Temporal worker it runs.
    "workers": {"workers"},
    # The library API a user's program calls: start and follow trajectories and runs.
    # `__init__` is the package root, which may export that API.
    "api": {
        "__init__",
        "branching",
        "client",
        "export",
        "integrations",
        "rollouts",
        "serve",
        "testing",
        "training",
    },
    # Starting a deployment's services and worker processes.
    "operations": {"stack"},
    # Programs built on the whole system: benchmarks, chaos runs, reports, and the measuring
    # helpers the benchmarks and chaos soaks share.
    "tools": {"bench", "chaos", "measure", "report"},
    # The `belayer` command, which registers every command.
    "cli": {"cli"},
}

# What a layer must not import, named even where the layer order alone already forbids it (so
# the rule outlives a change of order), with the fix: {layer: {target: fix}}. A target is a
# part of `belayer/`, a module of it by its dotted name, or a third-party package's top-level name.
_CONTRACTS = "import the payload models and error-type names from the contracts at the Temporal boundary"
_NO_TEMPORAL = "keep Temporal in workflows, activities and workers; take plain values as arguments"
_DOMAIN_IS_CALLED = "domain code is called by activities, workers and commands; pass what it needs in"
# Every sandbox backend's own module: only the registry (belayer/sandbox/backends.py) names one.
_BACKEND_MODULES = {
    "belayer.sandbox.podman": "get the configured backend from belayer.sandbox.backends.open_backend (or a "
    "SandboxHost's) and use the SandboxBackend interface; add a method to it where one is missing",
}
FORBIDDEN: dict[str, dict[str, str]] = {
    "base": {"temporalio": _NO_TEMPORAL},
    "domain": {
        "temporalio": _NO_TEMPORAL,
        "activities": _DOMAIN_IS_CALLED,
        "workflows": _DOMAIN_IS_CALLED,
        "workers": _DOMAIN_IS_CALLED,
        "cli": "a command belongs under cli/, which imports the domain code it runs",
    },
    "contracts": {
        "activities": "contracts are what activities implement: an activity imports its contract, never the reverse",
        "workers": "a contract names values, not the processes that serve them",
    },
    "workflows": {
        "activities": _CONTRACTS + ", not from the activity module",
        "workers": "worker processes are not a workflow's business; " + _CONTRACTS,
        "rollout": "rollout internals stay behind activities; " + _CONTRACTS,
        "sandbox": _CONTRACTS + ", not from the sandbox package",
        "trainer": _CONTRACTS + ", not from the trainer package",
    },
    **{layer: dict(_BACKEND_MODULES) for layer in ("activities", "workers", "api", "operations", "cli")},
    # Programs built on the system measure and break sandboxes through the backend, never
    # by driving podman themselves (the stack's host set-up may use the runtime).
    "tools": {**_BACKEND_MODULES, "belayer.sandbox.runtime": _BACKEND_MODULES["belayer.sandbox.podman"]},
}

# Violations of today, each with why it is still there; remove an entry with the import it names.
# Keys: "FILE -> MODULE" (an import), or "cycle: PART, PART, ..." (parts of one layer in a cycle).
KNOWN_VIOLATIONS: dict[str, str] = {}


@dataclass(frozen=True)
class Import:
    """One import of `target` (a `belayer` module, or a third-party top-level name) at `file:line`."""

    file: str
    line: int
    target: str


@dataclass(frozen=True)
class Violation:
    key: str
    message: str


def module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its `__init__.py`)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def part_of(module: str) -> str:
    """The part of `belayer/` that `module` belongs to (`__init__` for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def parts_on_disk() -> set[str]:
    """Every subpackage (a folder with `__init__.py`) and top-level module of `belayer/`."""
    found = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    found |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    if any(imports_of(PACKAGE / "__init__.py", "belayer", module_names())):
        found.add("__init__")
    return found


def layer_of(part: str) -> str | None:
    return next((layer for layer, parts in LAYERS.items() if part in parts), None)


def imports_of(path: Path, module: str, known: dict[str, Path], source: str | None = None) -> list[Import]:
    """Every import `path` makes, wherever it stands, of a `belayer` module (the most
    specific one it names) or of a third-party package (its top-level name)."""
    source = path.read_text() if source is None else source
    tree = ast.parse(source)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    file = str(path.relative_to(PACKAGE.parent)) if path.is_relative_to(PACKAGE.parent) else str(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        else:
            continue
        found += [Import(file, node.lineno, _target(name, known)) for name in dict.fromkeys(names)]
    if "import_module" in source:
        found += [
            Import(file, node.lineno, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known
        ]
    return found


def _target(name: str, known: dict[str, Path]) -> str:
    """The most specific known `belayer` module `name` is or lies in; else its top-level package."""
    if name != "belayer" and not name.startswith("belayer."):
        return name.split(".")[0]
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def all_imports() -> list[Import]:
    known = module_names()
    return [imp for module, path in known.items() for imp in imports_of(path, module, known)]


def rule_violations(imports: list[Import]) -> list[Violation]:
    """Imports of a higher layer, and imports `FORBIDDEN` names, keyed by file and module."""
    found = []
    for imp in imports:
        source = part_of(_module_of(imp.file))
        layer = layer_of(source)
        if layer is None:
            continue  # reported by the classification test
        target = part_of(imp.target) if imp.target.startswith("belayer") else imp.target
        where = f"{imp.file}:{imp.line} imports {imp.target}"
        forbidden = FORBIDDEN.get(layer, {})
        rule = next((name for name in (imp.target, target) if name in forbidden), None)
        if rule is not None:
            found.append(
                Violation(
                    f"{imp.file} -> {imp.target}",
                    f"{where}: {source} ({layer} layer) must not import {rule}; fix: {forbidden[rule]}",
                )
            )
            continue
        target_layer = layer_of(target) if imp.target.startswith("belayer") else None
        if target_layer is not None and _rank(target_layer) > _rank(layer):
            found.append(
                Violation(
                    f"{imp.file} -> {imp.target}",
                    f"{where}: {source} ({layer} layer) must not import {target} ({target_layer} layer, higher); "
                    f"fix: move the code that needs it up to the {target_layer} layer or above, or move what it "
                    f"uses down to the {layer} layer or below",
                )
            )
    return found


def cycle_violations(imports: list[Import]) -> list[Violation]:
    """Parts of one layer that import each other in a loop, one violation per loop."""
    edges: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    for imp in imports:
        source, target = part_of(_module_of(imp.file)), part_of(imp.target)
        if imp.target.startswith("belayer") and source != target and layer_of(source) == layer_of(target):
            edges[source][target].append(imp)
    found = []
    for loop in strongly_connected(edges):
        ties = [
            f"{imp.file}:{imp.line} imports {imp.target}"
            for source in loop
            for target in loop
            for imp in edges[source].get(target, [])
        ]
        found.append(
            Violation(
                f"cycle: {', '.join(loop)}",
                f"{', '.join(loop)} ({layer_of(loop[0])} layer) import each other in a cycle: "
                + "; ".join(ties)
                + "; fix: move what they share into a module both import, or move one of them to a layer above",
            )
        )
    return found


def strongly_connected(edges: dict[str, dict[str, list]]) -> list[list[str]]:
    """The groups of two or more nodes that reach each other (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def _module_of(file: str) -> str:
    parts = Path(file).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _rank(layer: str) -> int:
    return list(LAYERS).index(layer)


def violations() -> dict[str, list[str]]:
    """Every violation of today, its messages grouped under its key."""
    imports = all_imports()
    grouped: dict[str, list[str]] = defaultdict(list)
    for violation in rule_violations(imports) + cycle_violations(imports):
        grouped[violation.key].append(violation.message)
    return grouped


def test_every_part_of_the_package_has_a_layer():
    on_disk = parts_on_disk()
    classified = set().union(*LAYERS.values())
    unclassified = sorted(on_disk - classified)
    assert not unclassified, "\n".join(
        f"belayer/{part} is in no layer: add {part!r} to the layer it belongs to in LAYERS "
        "(tests/test_layering.py); it may import its own layer and those below"
        for part in unclassified
    )
    gone = sorted(classified - on_disk - {"__init__"})
    assert not gone, f"LAYERS names parts that belayer/ no longer has: {gone}; remove them"
    twice = sorted(part for part in classified if sum(part in parts for parts in LAYERS.values()) > 1)
    assert not twice, f"parts in more than one layer: {twice}"


def test_no_import_breaks_the_layering():
    new = {key: messages for key, messages in violations().items() if key not in KNOWN_VIOLATIONS}
    assert not new, (
        "imports that break the layering (see the rules at the top of tests/test_layering.py):\n"
        + ("\n".join(message for messages in new.values() for message in messages))
    )


def test_every_known_violation_still_exists():
    gone = sorted(set(KNOWN_VIOLATIONS) - set(violations()))
    assert not gone, "fixed, so remove from KNOWN_VIOLATIONS in tests/test_layering.py:\n" + "\n".join(gone)


def test_the_check_sees_imports_in_functions_relative_and_through_importlib(tmp_path):
    """The reader itself: an import inside a function, a relative import and a module
    loaded by `importlib.import_module` from a name in the same file all count."""
    known = module_names()
    path = tmp_path / "example.py"
    source = (
        "import importlib\n"
        "def f():\n"
        "    from belayer.storage import weights\n"
        "    from ..workflows.models import TrajectoryInput\n"
        "    import temporalio.client\n"
        "COMMANDS = ['belayer.cli.run']\n"
        "def g(name):\n"
        "    return importlib.import_module(name)\n"
    )
    found = imports_of(path, "belayer.model.example", known, source=source)
    assert [(imp.line, imp.target) for imp in found] == [
        (1, "importlib"),
        (3, "belayer.storage.weights"),
        (4, "belayer.workflows.models"),
        (5, "temporalio"),
        (6, "belayer.cli.run"),
    ]


def test_a_rule_can_forbid_one_module_of_a_part_it_may_otherwise_import():
    """Tools may import the sandbox package, but not a backend's own module."""
    allowed = Import("belayer/bench/example.py", 1, "belayer.sandbox.backends")
    backend = Import("belayer/bench/example.py", 2, "belayer.sandbox.podman")
    [violation] = rule_violations([allowed, backend])
    assert violation.key == "belayer/bench/example.py -> belayer.sandbox.podman"
    assert "must not import belayer.sandbox.podman; fix: get the configured backend" in violation.message


def test_contracts_hold_no_activity_side_code():
    """Workflows import the contracts into their sandbox, so nothing there may pull in what
    only an activity worker runs: `temporalio.activity` or the worker, or the sandbox beyond
    its value types and error names (the layers alone see packages, not these modules)."""
    found = []
    for path in sorted((PACKAGE / "contracts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {name}"
                for name in names
                if name.startswith(("temporalio.activity", "temporalio.worker"))
                or (
                    name.startswith("belayer.sandbox.")
                    and not name.startswith(("belayer.sandbox.models.", "belayer.sandbox.errors."))
                )
            ]
    assert not found, "contracts must stay workflow-safe:\n" + "\n".join(found)
