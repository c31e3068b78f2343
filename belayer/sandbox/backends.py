"""The sandbox-backend registry: the container engines Belayer can run sandboxes on, by name.

`sandbox.backend` names one (default `podman`, the only one today); the configuration
refuses a name no backend is registered under. `open_backend` is the one way to get the
configured backend: the sandbox host (`belayer.sandbox.host.make_host`), the stack's
status and its sandbox hosts, chaos and the benchmarks all call it, and use the
`SandboxBackend` interface only (tests/test_layering.py keeps them off
`belayer.sandbox.podman`).

A backend in this tree is one entry of `BACKENDS`; one that lives elsewhere calls
`register` before the configuration is loaded. belayer/sandbox/README.md says what a
backend implements and what its tests need.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from belayer.sandbox.backend import BackendFactory, SandboxBackend
from belayer.sandbox.podman import PodmanBackend

if TYPE_CHECKING:  # config.py validates `sandbox.backend` with `checked_name`
    from belayer.sandbox.config import SandboxConfig

BACKENDS: dict[str, BackendFactory] = {PodmanBackend.name: PodmanBackend}


def register(name: str, factory: BackendFactory) -> None:
    """Make `name` a valid `sandbox.backend`, opened by `factory`; a name is registered once."""
    if name in BACKENDS:
        raise ValueError(f"a sandbox backend named {name!r} is already registered ({BACKENDS[name]!r})")
    BACKENDS[name] = factory


def checked_name(name: str) -> str:
    """`name`, when a backend is registered under it; else a ValueError naming the known ones
    and the setting to change."""
    if name not in BACKENDS:
        known = ", ".join(sorted(BACKENDS))
        raise ValueError(f"no sandbox backend is named {name!r}; known backends: {known}. "
                         f"Set sandbox.backend to one of them")  # fmt: skip
    return name


def open_backend(cfg: SandboxConfig, state_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
                 *, command_prefix: Sequence[str] = ()) -> SandboxBackend:  # fmt: skip
    """The backend `cfg.backend` names, for this host's state and cache directories."""
    factory = BACKENDS[checked_name(cfg.backend)]
    return factory(cfg, Path(state_dir), None if cache_dir is None else Path(cache_dir),
                   command_prefix=tuple(command_prefix))  # fmt: skip
