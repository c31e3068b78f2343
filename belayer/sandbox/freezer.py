"""Thawing a frozen cgroup, so that the SIGKILLs sent into it land.

CRIU freezes a container's cgroup for the length of a dump. A process in a frozen
cgroup keeps a SIGKILL pending until the cgroup thaws, so killing every process of a
host in the middle of a checkpoint (`belayer.stack.sandbox_hosts.end`, a simulated power
cut) killed CRIU, which would have thawed them, and left the container's own processes
frozen for good: reparented to init, holding their memory, invisible to podman once its
runtime state was cleared. One such sandbox supervisor outlived a CI run.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def thaw(pid: int) -> bool:
    """Thaw the cgroup that holds `pid` if it is frozen; True when it was.

    A process that has exited, or a cgroup this process may not write, counts as not
    frozen: whoever waits for the process then reports that it stayed.
    """
    control = freezer_control(pid)
    if control is None or not _frozen(control):
        return False
    path, _, thawed = control
    try:
        path.write_text(thawed)
    except OSError:
        return False
    return True


def is_frozen(pid: int) -> bool:
    """Whether the cgroup that holds `pid` is frozen (or freezing)."""
    control = freezer_control(pid)
    return control is not None and _frozen(control)


def _frozen(control: tuple[Path, set[str], str]) -> bool:
    path, frozen, _ = control
    try:
        return path.read_text().strip() in frozen
    except OSError:
        return False


def tasks(pid: int) -> list[int]:
    """Every task (thread id) in the freezer cgroup that holds `pid`."""
    control = freezer_control(pid)
    if control is None:
        return []
    listing = control[0].parent / ("tasks" if control[0].name == "freezer.state" else "cgroup.threads")
    try:
        return [int(t) for t in listing.read_text().split()]
    except (OSError, ValueError):
        return []


def freezer_control(pid: int) -> tuple[Path, set[str], str] | None:
    """The file that freezes the cgroup of `pid`, the values that mean frozen and the
    value that thaws: cgroup v1's freezer.state when the freezer controller has a
    hierarchy of its own, else cgroup v2's cgroup.freeze. None when `pid` has exited."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            return (
                CGROUP_ROOT / "freezer" / path.lstrip("/") / "freezer.state",
                {"FROZEN", "FREEZING"},
                "THAWED",
            )
        if controllers == "":
            unified = CGROUP_ROOT / path.lstrip("/") / "cgroup.freeze"
    if unified is not None and unified.exists():
        return unified, {"1"}, "0"
    return None
