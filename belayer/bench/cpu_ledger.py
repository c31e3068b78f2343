"""CPU spent by every process on the machine over a window, split by process: what
`belayer bench turn-throughput` charges to each part of the control plane.

A sampler process (`python -m belayer.bench.cpu_ledger`, started by `CpuLedger`) reads
`/proc/<pid>/stat` of every process every `interval_s` until it is told to stop, then
prints one JSON line: per process its name, command line, parent and the CPU seconds it
spent inside the window. The sampler runs apart so that its own reading is not charged
to the process being measured; it leaves itself out. A process is named as it was last
seen (after an exec) and its parent is the last one seen (after an adoption).

A process's own time (utime + stime) is counted from its first sample in the window (0
for one born inside it) to its last. A process that ends between two samples loses what
it spent after its last one; its parent gets that back when it reaps it (the parent's
children time, cutime + cstime, grows by the child's whole life), so the parent is
charged that growth less what was already counted of the child. A child reaped by a
process outside the window's view (an orphan adopted by init) loses that tail.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass
class _Seen:
    name: str
    command: str
    parent: int
    own_first: int  # ticks at the first sample (0: born inside the window)
    children_first: int
    own_last: int = 0
    children_last: int = 0
    reaped_counted: int = 0  # what was counted of its children that ended (their last samples)
    alive: bool = True


@dataclass
class _Sampler:
    me: int
    seen: dict[int, _Seen] = field(default_factory=dict)
    started: bool = False

    def sample(self) -> None:
        now = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and int(entry.name) != self.me:
                stat = _stat(int(entry.name))
                if stat is not None:
                    now[int(entry.name)] = stat
        for pid, (name, parent, own, children) in now.items():
            seen = self.seen.get(pid)
            if seen is None or not seen.alive:  # new (or a reused pid)
                born_before = not self.started
                seen = self.seen[pid] = _Seen(
                    name=name,
                    command=_command(pid),
                    parent=parent,
                    own_first=own if born_before else 0,
                    children_first=children if born_before else 0,
                )
            elif seen.name != name:  # exec'd (runc init becoming the container's first process)
                seen.name, seen.command = name, _command(pid)
            # The latest parent: the one whose children time grows when this one is reaped
            # (runc's init is adopted by conmon, conmon by init).
            seen.parent, seen.own_last, seen.children_last = parent, own, children
        for pid, seen in self.seen.items():
            if seen.alive and pid not in now:
                seen.alive = False
                parent = self.seen.get(seen.parent)
                if parent is not None:
                    parent.reaped_counted += seen.own_last + seen.children_last
        self.started = True

    def report(self) -> dict:
        processes = {}
        for pid, seen in self.seen.items():
            own = seen.own_last - seen.own_first
            tail = max(0, seen.children_last - seen.children_first - seen.reaped_counted)
            processes[pid] = {
                "name": seen.name,
                "command": seen.command,
                "parent": seen.parent,
                "cpu_s": round((own + tail) / TICKS_PER_S, 3),
            }
        return processes


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(name, parent pid, own ticks, reaped children's ticks); None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15), 0-based from state
    return name, int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return ""


class CpuLedger:
    """`with CpuLedger() as ledger: ...` then `ledger.processes`: pid -> name, command,
    parent, cpu_s spent inside the block."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.processes: dict[int, dict] = {}
        self.wall_s = 0.0

    def __enter__(self) -> CpuLedger:
        self._sampler = subprocess.Popen(
            [sys.executable, "-m", "belayer.bench.cpu_ledger", str(self.interval_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._sampler.stdout.readline().strip() != "sampling":  # its first sample is taken
            raise RuntimeError("the CPU sampler did not start")
        self._started = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.monotonic() - self._started
        out, _ = self._sampler.communicate("stop\n", timeout=60)
        self.processes = {int(pid): row for pid, row in json.loads(out).items()}


def main(interval_s: float) -> None:
    """Sample until a line arrives on stdin; print the window's report."""
    sampler = _Sampler(me=os.getpid())
    sampler.sample()
    print("sampling", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    while not selector.select(timeout=interval_s):
        sampler.sample()
    sampler.sample()
    print(json.dumps(sampler.report()), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
