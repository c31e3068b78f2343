"""`belayer bench checkpoint`: what one full checkpoint and one restore cost, phase by phase,
against podman + CRIU driven the obvious way, in one run.

The sandbox is the overhead bench's (`examples/workloads/overhead.yaml`, every turn run:
a 4.5 MB data set and a virtual environment in the tmpfs workspace, a server holding
~40 MB in memory). Each repetition, in an order rotated per repetition, measures:

  belayer -- `SandboxHost.checkpoint` (the archive streamed through the compressor into
             the object store, its metadata stored), then the container SIGKILLed and
             `SandboxHost.restore` until the supervisor answers at the new generation
             with the checkpoint's journal;
  podman  -- what a user of podman would write without Belayer: `podman container
             checkpoint --leave-running -c zstd --export FILE` with the system's tools,
             FILE uploaded to the same object store; then the container SIGKILLed, FILE
             downloaded, `podman container restore --import FILE`, until the same
             supervisor answers. (This is also how Belayer checkpointed before it cut
             the phases below.) It is the same container, so CRIU reads the
             configuration Belayer gave it (infra/podman/criu.conf) here too: without
             Belayer, each dump and restore would also lock the network (~0.05 s each).
             The backend runs both commands (`SandboxBackend.baseline_checkpoint` and
             `baseline_restore`), so this module drives no engine itself; the mode keeps
             the name of the only backend there is, podman.

Both clocks stop where a user stops waiting: the checkpoint stored, the sandbox ready to
take the next action. Belayer's phases come from the checkpoint's metadata
(`CheckpointMeta.phases`) and the restore's own laps; podman's from `--print-stats`.
Nothing here is simulated.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from belayer.measure import rotated, spread, spread_cells
from belayer.sandbox import channel
from belayer.sandbox.models import Action, SandboxSpec

MODES = ("belayer", "podman")
DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "overhead.yaml"
MiB = 1 << 20


@dataclass
class Sample:
    """One mode's checkpoint and restore in one repetition."""

    mode: str
    checkpoint_s: float
    restore_s: float
    archive_mb: float
    checkpoint_phases: dict[str, float]
    restore_phases: dict[str, float]
    consistent: bool = False  # the restored /workspace hashes as it did after the set-up (`Bench.run`)


def schedule(repetitions: int) -> list[tuple[int, str]]:
    """(repetition, mode), the order rotated each repetition."""
    return rotated(MODES, repetitions)


class Bench:
    """One sandbox, checkpointed and restored by each mode in turn."""

    def __init__(self, host, say: Callable[[str], None]):
        self.host = host
        self.say = say
        self.handle = None
        self.workspace_sha256 = ""

    def set_up(self, task) -> None:
        self.handle = self.host.create(SandboxSpec(setup_commands=task.setup))
        trajectory = f"bench-checkpoint-{uuid.uuid4().hex[:8]}"
        for step, turn in enumerate(task.turns, 1):
            obs = self.host.exec(self.handle, Action(trajectory=trajectory, step=step, command=turn.bash))
            if obs.exit_code != 0:
                raise click.ClickException(
                    f"turn {step} of {task.id} failed (exit {obs.exit_code}): {obs.output[-300:]}"
                )
        self.workspace_sha256 = self.host.workspace_hash(self.handle)
        self.say(f"sandbox {self.handle.sandbox_id} set up: {len(task.turns)} turns of {task.id}")

    def run(self, mode: str) -> Sample:
        sample = self._belayer() if mode == "belayer" else self._podman()
        sample.consistent = self.host.workspace_hash(self.handle) == self.workspace_sha256
        return sample

    def tear_down(self) -> None:
        if self.handle is not None:
            self.host.destroy(self.handle)
            self.host.delete_checkpoints(self.handle.sandbox_id)

    def _belayer(self) -> Sample:
        started = time.monotonic()
        ref = self.host.checkpoint(self.handle)
        checkpoint_s = time.monotonic() - started
        meta = self.host.load_meta(ref)
        self.host.kill(self.handle)
        restore_phases: dict[str, float] = {}
        started = time.monotonic()
        self.handle, _ = self.host.restore(ref, self.handle.generation + 1, phases=restore_phases)
        restore_s = time.monotonic() - started
        phases = dict(meta.phases) | {"metadata": checkpoint_s - meta.dump_s}
        return Sample("belayer", checkpoint_s, restore_s, ref.archive_bytes / MiB, phases, restore_phases)

    def _podman(self) -> Sample:
        """The baseline: the backend's checkpoint and restore as its user drives them without
        Belayer (`SandboxBackend.baseline_checkpoint`), the archive through the same store."""

        backend, store = self.host.backend, self.host.store
        container = self.handle.container
        key = f"bench/checkpoint/{self.handle.sandbox_id}-{uuid.uuid4().hex[:8]}.tar.zst"
        # Resume what the last workspace hash froze, as the host does before its own dumps:
        # CRIU cannot dump a stopped process here (SandboxHost._idle_info says why).
        channel.call(backend.channel_path(self.handle.sandbox_id), {"op": "quiesce"})
        with tempfile.TemporaryDirectory(dir=self.host.state_dir / "tmp") as d:
            archive = Path(d) / "archive.tar.zst"
            started = time.monotonic()
            baseline_phases = backend.baseline_checkpoint(container, archive)
            dumped = time.monotonic()
            with open(archive, "rb") as f:
                store.upload_stream(key, iter(lambda: f.read(MiB), b""))
            checkpoint_s = time.monotonic() - started
            checkpoint_phases = baseline_phases | {"upload": time.monotonic() - dumped}
            size_mb = archive.stat().st_size / MiB
            archive.unlink()
            backend.kill(container)
            started = time.monotonic()
            with open(archive, "wb") as f:
                store.download_stream(key, f)
            fetched = time.monotonic()
            backend.baseline_restore(container, archive)
            restored = time.monotonic()
            channel.wait_ready(backend.channel_path(self.handle.sandbox_id), self.host.cfg.start_timeout_s)
            restore_s = time.monotonic() - started
        store.delete_prefix(key)
        return Sample(
            "podman",
            checkpoint_s,
            restore_s,
            size_mb,
            checkpoint_phases,
            {
                "fetch": fetched - started,
                "podman": restored - fetched,
                "ready": started + restore_s - restored,
            },
        )


def summarize(samples: list[Sample], repetitions: int, compression: str) -> dict:
    """min / median / max per mode, the medians' ratios, and every phase's spread."""
    by_mode = {mode: [s for s in samples if s.mode == mode] for mode in MODES}
    report: dict = {"repetitions": repetitions, "compression": compression, "modes": {}}
    for mode, rows in by_mode.items():
        report["modes"][mode] = {
            "checkpoint_s": spread(s.checkpoint_s for s in rows),
            "restore_s": spread(s.restore_s for s in rows),
            "archive_mb": spread((s.archive_mb for s in rows), digits=1),
            "checkpoint_phases_s": _phase_spreads([s.checkpoint_phases for s in rows]),
            "restore_phases_s": _phase_spreads([s.restore_phases for s in rows]),
            "consistent": all(s.consistent for s in rows),
        }
    for what in ("checkpoint_s", "restore_s"):
        ours, theirs = report["modes"]["belayer"][what], report["modes"]["podman"][what]
        report[f"{what.removesuffix('_s')}_speedup"] = (
            round(theirs["median"] / ours["median"], 2) if ours and theirs and ours["median"] else None
        )
        report[f"belayer_{what}"] = ours["median"] if ours else None
    report["samples"] = [s.__dict__ for s in samples]
    return report


def _phase_spreads(phase_dicts: list[dict[str, float]]) -> dict:
    names = [name for phases in phase_dicts for name in phases]
    return {name: spread(p.get(name) for p in phase_dicts) for name in dict.fromkeys(names)}


def print_report(report: dict) -> None:
    out = Console(width=max(Console().width, 120))
    table = Table(
        title=f"checkpoint and restore of the overhead bench's sandbox, seconds over "
        f"{report['repetitions']} repetitions (min / median / max)"
    )
    for col in ("mode", "checkpoint", "restore to ready", "archive MiB", "consistent"):
        table.add_column(col)
    for mode, row in report["modes"].items():
        table.add_row(
            mode,
            _cells(row["checkpoint_s"]),
            _cells(row["restore_s"]),
            _cells(row["archive_mb"]),
            "yes" if row["consistent"] else "NO",
        )
    out.print(table)
    for mode, row in report["modes"].items():
        for what in ("checkpoint_phases_s", "restore_phases_s"):
            parts = ", ".join(f"{name} {s['median']:.3f}" for name, s in row[what].items() if s)
            out.print(f"{mode} {what.split('_')[0]} phases (medians, s): {parts}")
    out.print(
        f"speedup of the medians: checkpoint {report['checkpoint_speedup']}x, "
        f"restore {report['restore_speedup']}x"
    )


def _cells(s: dict | None) -> str:
    return "-" if s is None else " / ".join(spread_cells(s))
