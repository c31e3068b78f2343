"""The sandbox runtime on this host: podman + runc + CRIU, configured for Belayer only.

Everything that runs podman goes through `podman_env()` and `podman_base_args()`:

* ``CONTAINERS_CONF`` / ``CONTAINERS_STORAGE_CONF`` point at the project's own
  ``infra/podman/containers.conf`` and ``storage.conf``, so the user's podman setup
  (``/etc/containers``, ``~/.config/containers``) is never read nor changed;
* podman's storage lives under Belayer's state dir (``$BELAYER_STATE_DIR``, default
  ``~/.local/state/belayer``): ``podman/root`` (``--root``), ``podman/runroot``
  (``--runroot``), ``podman/tmp`` (``--tmpdir``: libpod's locks and events log) and
  ``podman/networks`` (``--network-config-dir``). A checkpoint restores only on a host
  whose ``--root`` and ``--runroot`` are the same paths (docs/design.md §7), so every
  sandbox host must use the same state dir path;
* the CRIU is ``$BELAYER_CACHE_DIR/bin/criu`` (default ``~/.cache/belayer/bin/criu``),
  written by ``infra/install/criu.sh``. runc is told so on every call with
  ``--runtime-flag=criu=<path>`` (podman passes runtime flags to each runc call, the
  ones conmon makes included), and that directory comes first on ``PATH`` because
  podman itself runs ``criu`` from ``PATH`` to check its version before a checkpoint.

Stdlib only. Also a script, so shell code can share the exact same arguments::

    python3 belayer/sandbox/runtime.py base-args   # one podman global arg per line
    python3 belayer/sandbox/runtime.py env         # KEY=VALUE lines to export
    python3 belayer/sandbox/runtime.py check       # health report, exit 1 if unhealthy
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
INFRA_DIR = REPO_ROOT / "infra"
PODMAN_CONF_DIR = INFRA_DIR / "podman"
# Found by CRIU on PATH ahead of the system's: a `tar` that keeps gzip out of the frozen
# window (infra/podman/criu-tools/tar says why).
CRIU_TOOLS_DIR = PODMAN_CONF_DIR / "criu-tools"
# The CRIU configuration of Belayer's sandboxes (the file says what it sets and why).
CRIU_CONFIG = PODMAN_CONF_DIR / "criu.conf"
# The action script that configuration names, as the repository holds it; it runs from
# the fixed path criu.conf names, where infra/install/criu-action-script.sh installs it.
CRIU_ACTION_SCRIPT = PODMAN_CONF_DIR / "criu-action-script"
VERSIONS_ENV = INFRA_DIR / "versions.env"

INSTALL_HINT = "run `make install` (or `bash infra/install/sandbox-runtime.sh`) as root"
_TIMEOUT_S = 60.0


# ----------------------------------------------------------------------------- paths


def _versions() -> dict[str, str]:
    values: dict[str, str] = {}
    try:
        text = VERSIONS_ENV.read_text()
    except OSError:
        return values
    for line in text.splitlines():
        m = re.match(r"\s*([A-Z0-9_]+)=([^\s#]*)", line)
        if m:
            values[m.group(1)] = m.group(2).strip("\"'")
    return values


def _parse_version(text: str) -> tuple[int, ...]:
    m = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def criu_min_version() -> tuple[int, ...]:
    """The CRIU floor from infra/versions.env (4.2 on kernel 6.x)."""
    return _parse_version(_versions().get("CRIU_MIN_VERSION", "4.2")) or (4, 2)


def base_image_name() -> str:
    """``localhost/belayer-base:v<BASE_IMAGE_VERSION>``, as infra/install/base-image.sh tags it."""
    return f"localhost/belayer-base:v{_versions().get('BASE_IMAGE_VERSION', '1')}"


def default_state_dir() -> Path:
    return Path(os.environ.get("BELAYER_STATE_DIR") or "~/.local/state/belayer").expanduser()


def default_cache_dir() -> Path:
    return Path(os.environ.get("BELAYER_CACHE_DIR") or "~/.cache/belayer").expanduser()


def _state(state_dir: str | os.PathLike[str] | None) -> Path:
    return Path(state_dir).expanduser() if state_dir is not None else default_state_dir()


def _cache(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def podman_dirs(state_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Belayer's podman directories under the state dir (absolute paths)."""
    base = _state(state_dir).absolute() / "podman"
    return {
        "root": base / "root",
        "runroot": base / "runroot",
        "tmpdir": base / "tmp",
        "networks": base / "networks",
    }


def seccomp_profile_path(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Belayer's seccomp profile of its sandboxes, which belayer/sandbox/seccomp.py writes
    from podman's default profile as installed on this host."""
    return _state(state_dir).absolute() / "podman" / "seccomp.json"


def fork_criu_config(sandbox_id: str, state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a fork that closed TCP connections names its CRIU configuration (`write_fork_criu_config`)."""
    return _state(state_dir).absolute() / "podman" / "criu-fork" / f"{sandbox_id}.conf"


def write_fork_criu_config(sandbox_id: str, state_dir: str | os.PathLike[str] | None = None, *,
                           closing: bool) -> Path:  # fmt: skip
    """A fork's CRIU configuration: CRIU_CONFIG plus `tcp-close` while the fork is restored
    from a checkpoint holding established TCP connections (podman 4.3 has no --tcp-close),
    CRIU_CONFIG alone once it runs (`closing=False`): CRIU reads the file at every dump, and
    a dump made with tcp-close keeps no connection for a later restore."""
    path = fork_criu_config(sandbox_id, state_dir)
    text = CRIU_CONFIG.read_text()
    if closing:
        text += "# The fork's restore: established connections come back closed (two forks cannot own one).\ntcp-close\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(text)
    partial.replace(path)
    return path


def criu_bin_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return _cache(cache_dir).absolute() / "bin"


def criu_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The CRIU Belayer (and runc, through podman) uses: a wrapper written by criu.sh."""
    return criu_bin_dir(cache_dir) / "criu"


# ------------------------------------------------------------------- podman invocation


def podman_env(
    state_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The full environment to run podman with (``base``, default os.environ, plus ours).

    ``state_dir`` is accepted for symmetry with `podman_base_args`; the state-dependent
    paths are flags, since containers.conf cannot expand them.
    """
    del state_dir
    env = dict(os.environ if base is None else base)
    env["CONTAINERS_CONF"] = str(PODMAN_CONF_DIR / "containers.conf")
    env["CONTAINERS_STORAGE_CONF"] = str(PODMAN_CONF_DIR / "storage.conf")
    ours = [str(CRIU_TOOLS_DIR), str(criu_bin_dir(cache_dir))]
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p not in ours]
    # /usr/sbin for runc and podman's helpers when run from a non-login environment.
    for extra in ("/usr/local/sbin", "/usr/sbin", "/sbin"):
        if extra not in path:
            path.append(extra)
    env["PATH"] = os.pathsep.join([*ours, *path])
    return env


def podman_base_args(
    state_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Global podman flags that select Belayer's storage and CRIU; put them before the verb."""
    d = podman_dirs(state_dir)
    return [
        "--root", str(d["root"]),
        "--runroot", str(d["runroot"]),
        "--tmpdir", str(d["tmpdir"]),
        "--network-config-dir", str(d["networks"]),
        f"--runtime-flag=criu={criu_path(cache_dir)}",
    ]  # fmt: skip


def podman_command(
    *args: str,
    state_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[str]:
    """``["podman", <base args>, *args]``; run it with ``env=podman_env(...)``."""
    return ["podman", *podman_base_args(state_dir, cache_dir), *args]


def run_podman(
    *args: str,
    state_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    timeout: float | None = _TIMEOUT_S,
    check: bool = False,
    prefix: list[str] | None = None,
    **kwargs,
) -> subprocess.CompletedProcess[str]:
    """Run podman with Belayer's env and flags, capturing text output; `prefix` runs it
    through another command first (`nsenter` into a sandbox host's namespaces)."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(
        [*(prefix or []), *podman_command(*args, state_dir=state_dir, cache_dir=cache_dir)],
        env=podman_env(state_dir, cache_dir),
        text=True,
        timeout=timeout,
        check=check,
        **kwargs,
    )


# ------------------------------------------------------------------------------ CRIU


def criu_version(path: str | os.PathLike[str] | None = None) -> tuple[int, ...]:
    """Version of Belayer's CRIU, e.g. (4, 2, 1); () when it is missing or does not run."""
    exe = Path(path) if path is not None else criu_path()
    try:
        out = subprocess.run(
            [str(exe), "--version"],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    m = re.search(r"^Version:\s*(\S+)", out, re.M)
    return _parse_version(m.group(1)) if m else ()


def criu_route(path: str | os.PathLike[str] | None = None) -> str | None:
    """How criu.sh provided the CRIU (``system``/``sid``/``source`` plus details)."""
    exe = Path(path) if path is not None else criu_path()
    try:
        for line in exe.read_text(errors="replace").splitlines()[:5]:
            if line.startswith("# route: "):
                return line[len("# route: ") :]
    except OSError:
        pass
    return None


def installed_action_script() -> Path | None:
    """Where criu.conf tells CRIU to find its action script (None: it names none)."""
    try:
        text = CRIU_CONFIG.read_text()
    except OSError:
        return None
    m = re.search(r"^action-script\s+(\S+)", text, re.M)
    return Path(m.group(1)) if m else None


def action_script_problem() -> str | None:
    """Why this host's sandboxes could not be restored for want of the action script, or None."""
    installed = installed_action_script()
    fix = f"{INSTALL_HINT} (infra/install/criu-action-script.sh)"
    if installed is None:
        return f"{CRIU_CONFIG} names no action-script: restores of sandboxes fail without it"
    try:
        same = installed.read_bytes() == CRIU_ACTION_SCRIPT.read_bytes()
    except FileNotFoundError:
        return f"CRIU action script {installed} is missing (sandbox restores fail without it): {fix}"
    return None if same else f"CRIU action script {installed} differs from {CRIU_ACTION_SCRIPT}: {fix}"


# ---------------------------------------------------------------------------- health


@dataclasses.dataclass
class RuntimeHealth:
    """What `check_runtime` found. ``problems`` name the fix; empty means healthy."""

    state_dir: Path
    is_root: bool
    podman_version: str | None = None
    runc_path: str | None = None
    runc_version: str | None = None
    criu_path: Path | None = None
    criu_version: tuple[int, ...] = ()
    criu_route: str | None = None
    criu_check_ok: bool | None = None  # None: not run (not root, or no CRIU)
    criu_check_output: str = ""
    image: str = ""
    image_id: str | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Sandboxes can run, checkpoint and restore on this host."""
        return not self.problems

    @property
    def can_run(self) -> bool:
        """Containers from the base image can run (checkpointing aside)."""
        return bool(self.podman_version and self.runc_path and self.image_id)

    @property
    def can_checkpoint(self) -> bool:
        return self.can_run and self.is_root and bool(self.criu_check_ok)

    def summary(self) -> str:
        v = ".".join(map(str, self.criu_version)) or "missing"
        lines = [
            f"state dir:  {self.state_dir}",
            f"root:       {'yes' if self.is_root else 'no'}",
            f"podman:     {self.podman_version or 'missing'}",
            f"runc:       {self.runc_version or 'missing'}"
            + (f" ({self.runc_path})" if self.runc_path else ""),
            f"criu:       {v} ({self.criu_path}; route: {self.criu_route or '?'})",
            "criu check: "
            + {True: "ok", False: "FAILED", None: "not run"}[self.criu_check_ok]
            + (f" ({self.criu_check_output})" if self.criu_check_output else ""),
            f"image:      {self.image} " + (f"id {self.image_id}" if self.image_id else "missing"),
        ]
        lines += [f"problem:    {p}" for p in self.problems]
        lines += [f"note:       {n}" for n in self.notes]
        lines.append("healthy" if self.ok else "UNHEALTHY")
        return "\n".join(lines)


def _first_line(cmd: list[str], env: dict[str, str] | None = None) -> str | None:
    try:
        r = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    out = r.stdout.strip().splitlines()
    return out[0] if out else ""


def check_runtime(
    state_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    run_criu_check: bool = True,
) -> RuntimeHealth:
    """Check podman, runc, CRIU and the base image; every problem names its fix."""
    is_root = os.geteuid() == 0
    h = RuntimeHealth(state_dir=_state(state_dir), is_root=is_root, image=base_image_name())
    env = podman_env(state_dir, cache_dir)

    line = _first_line(["podman", "--version"], env)
    if line:
        h.podman_version = line.split()[-1]
    else:
        h.problems.append(f"podman is not installed: {INSTALL_HINT} (infra/install/podman.sh)")

    h.runc_path = shutil.which("runc", path=env["PATH"])
    if h.runc_path:
        line = _first_line([h.runc_path, "--version"], env)
        h.runc_version = line.split()[-1] if line else None
    else:
        h.problems.append(f"runc is not installed: {INSTALL_HINT} (infra/install/podman.sh)")

    h.criu_path = criu_path(cache_dir)
    h.criu_version = criu_version(h.criu_path)
    h.criu_route = criu_route(h.criu_path)
    floor = criu_min_version()
    floor_s = ".".join(map(str, floor))
    if not h.criu_version:
        h.problems.append(f"no working CRIU at {h.criu_path}: {INSTALL_HINT} (infra/install/criu.sh)")
    elif h.criu_version < floor:
        h.problems.append(
            f"CRIU {'.'.join(map(str, h.criu_version))} at {h.criu_path} is below {floor_s} "
            f"(this kernel needs it): rerun infra/install/criu.sh as root"
        )
    elif is_root and run_criu_check:
        try:
            r = subprocess.run(
                [str(h.criu_path), "check"],
                capture_output=True,
                text=True,
                timeout=_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
            h.criu_check_ok = r.returncode == 0
            h.criu_check_output = " ".join((r.stdout + r.stderr).split())
        except (OSError, subprocess.SubprocessError) as exc:
            h.criu_check_ok, h.criu_check_output = False, str(exc)
        if not h.criu_check_ok:
            h.problems.append(
                f"`criu check` fails ({h.criu_check_output}): the kernel lacks a feature CRIU "
                "needs; rerun infra/install/criu.sh as root and read its output"
            )

    script_problem = action_script_problem()
    if script_problem:
        h.problems.append(script_problem)

    if not is_root:
        h.problems.append(
            "not running as root: checkpoint/restore needs root (CRIU), so full sandbox "
            "checkpoints and restores are unavailable. Without root, Temporal, storage and "
            "rollout engines still work, and sandbox recovery can only replay actions in a "
            "fresh sandbox, which itself needs rootless podman (subuid ranges; Belayer does "
            "not set that up). Fix: run the sandbox host as root (`sudo`), after "
            f"{INSTALL_HINT}"
        )

    if h.podman_version:
        r = None
        try:
            r = run_podman(
                "image",
                "inspect",
                "--format",
                "{{.Id}}",
                h.image,
                state_dir=state_dir,
                cache_dir=cache_dir,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            h.notes.append(f"podman image inspect failed: {exc}")
        if r is not None and r.returncode == 0 and r.stdout.strip():
            h.image_id = r.stdout.strip().splitlines()[0]
        else:
            err = " ".join((r.stderr if r is not None else "").split())[:300]
            h.problems.append(
                f"base image {h.image} is not in Belayer's podman storage "
                f"({podman_dirs(state_dir)['root']}): {INSTALL_HINT} (infra/install/base-image.sh)"
                + (f" [podman: {err}]" if err and "image not known" not in err else "")
            )
    from belayer.sandbox import toolchain  # cycle: toolchain imports this module

    if toolchain.installed(cache_dir) is None:
        h.problems.append(
            f"no trusted toolchain for this checkout under {toolchain.toolchain_root(cache_dir)}: "
            f"{INSTALL_HINT} (infra/install/toolchain.sh)"
        )
    return h


# ------------------------------------------------------------------------------ script


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="runtime.py", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["base-args", "env", "check", "criu-path", "image"])
    p.add_argument("--state-dir", default=None)
    p.add_argument("--cache-dir", default=None)
    a = p.parse_args(argv)
    if a.what == "base-args":
        print("\n".join(podman_base_args(a.state_dir, a.cache_dir)))
    elif a.what == "env":
        env = podman_env(a.state_dir, a.cache_dir, base={"PATH": os.environ.get("PATH", "")})
        for k, v in env.items():
            print(f"{k}={v}")
    elif a.what == "criu-path":
        print(criu_path(a.cache_dir))
    elif a.what == "image":
        print(base_image_name())
    else:
        h = check_runtime(a.state_dir, a.cache_dir)
        print(h.summary())
        return 0 if h.ok else 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))  # `check` imports belayer.sandbox.toolchain
    sys.exit(_main(sys.argv[1:]))
