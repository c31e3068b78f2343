"""`belayer bench storage`: object store throughput next to a local disk copy, same run.

One file of random bytes is copied on local disk (the baseline), uploaded through
`ObjectStore.upload_stream` and downloaded through `ObjectStore.download_stream`
(both sha256-verified, exactly the checkpoint path), `--repetitions` times with the
order of the three rotated each repetition, so a busy spell of the machine does not
land on one path only. The first repetition uploads before it downloads; a later one
may download first, the object the previous repetition uploaded (the same bytes).
MB here means MiB (2**20 bytes). The local copy goes through the page cache without
fsync, as SeaweedFS's writes do. Every MB/s figure is the median of the repetitions,
`NAME_spread` beside it their min / median / max; the `*_vs_local` ratios are of the
medians. Everything the bench creates (temp files, the object) is removed, even on failure.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from belayer.measure import rotated, spread
from belayer.storage.config import StorageConfig
from belayer.storage.store import open_store

MiB = 1 << 20
COPY_CHUNK = 16 * MiB
# The first repetition's order: the upload precedes the download that reads its object.
MODES = ("local_copy", "upload", "download")
LABELS = {"local_copy": "local copy", "upload": "upload", "download": "download"}


def schedule(repetitions: int) -> list[tuple[int, str]]:
    """(repetition, path), the order rotated each repetition."""
    return rotated(MODES, repetitions)


def run_storage_bench(
    cfg: StorageConfig,
    *,
    size_mb: int,
    repetitions: int = 3,
    work_dir: Path | None = None,
    console: Console | None = None,
) -> dict:
    """Measure; returns the figures as a dict (the JSON the command prints)."""
    size = size_mb * MiB
    key = f"bench/storage-{uuid.uuid4().hex}"
    console = console or Console(stderr=True)
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory(prefix="belayer-bench-", dir=work_dir) as tmp,
        open_store(cfg, encrypted=False) as store,
    ):
        store.check()  # fail before writing a large file when endpoint, bucket or keys are wrong
        source, local_copy, downloaded = (Path(tmp) / name for name in ("source", "copy", "downloaded"))

        def upload(tick: Callable[[int], None]) -> None:
            with source.open("rb") as src:
                store.upload_stream(key, src, progress=tick)

        def download(tick: Callable[[int], None]) -> None:
            with downloaded.open("wb") as dest:
                store.download_stream(key, dest, progress=tick)

        steps = {
            "local_copy": lambda tick: _copy(source, local_copy, tick),
            "upload": upload,
            "download": download,
        }
        try:
            with _progress(console) as progress:
                _timed(progress, "write source", size, lambda tick: _write_random(source, size, tick))
                for rep, mode in schedule(repetitions):
                    label = f"{LABELS[mode]} {rep + 1}/{repetitions}"
                    seconds[mode].append(_timed(progress, label, size, steps[mode]))
                    if mode == "local_copy":
                        local_copy.unlink()  # not timed: the copy's clock stops at its last byte
        finally:
            store.delete(key)
    return summarize(seconds, size_mb=size_mb, cfg=cfg)


def summarize(seconds: dict[str, list[float]], *, size_mb: int, cfg: StorageConfig) -> dict:
    """MB/s of each path from its repetitions' seconds: the median under the figure's own
    name (the single figure readers of one-sample runs know), the spread beside it."""
    rates = {mode: [size_mb / s for s in seconds[mode]] for mode in MODES}
    median = {mode: statistics.median(rates[mode]) for mode in MODES}
    return {
        "size_mb": size_mb,
        "part_size_mb": cfg.part_size_mb,
        "endpoint": cfg.endpoint,
        "repetitions": len(seconds["upload"]),
        **{f"{mode}_mb_s": round(median[mode], 1) for mode in MODES},
        "upload_vs_local": round(median["upload"] / median["local_copy"], 3),
        "download_vs_local": round(median["download"] / median["local_copy"], 3),
        **{f"{mode}_mb_s_spread": spread(rates[mode], digits=1) for mode in MODES},
    }


def result_table(result: dict) -> Table:
    table = Table(
        title=f"{result['size_mb']} MiB via {result['endpoint']}: MB/s, "
        f"min / median / max of {result['repetitions']}"
    )
    table.add_column("path")
    for column in ("min", "median", "max", "median vs local copy"):
        table.add_column(column, justify="right")
    rows = (
        ("local disk copy", "local_copy", 1.0),
        ("upload (verified)", "upload", result["upload_vs_local"]),
        ("download (verified)", "download", result["download_vs_local"]),
    )
    for label, mode, vs_local in rows:
        figures = result[f"{mode}_mb_s_spread"]
        table.add_row(label, *(f"{figures[k]:.1f}" for k in ("min", "median", "max")), f"{vs_local:.3f}")
    return table


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<16}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        console=console,
        transient=False,
    )


def _timed(
    progress: Progress, label: str, size: int, step: Callable[[Callable[[int], None]], object]
) -> float:
    """Seconds `step` took; it reports bytes done so far through the callback it is given."""
    task = progress.add_task(label, total=size)
    started = time.perf_counter()
    step(lambda done: progress.update(task, completed=done))
    elapsed = time.perf_counter() - started
    progress.update(task, completed=size)
    return max(elapsed, 1e-9)


def _write_random(path: Path, size: int, tick: Callable[[int], None]) -> None:
    written = 0
    with path.open("wb") as out:
        while written < size:
            chunk = os.urandom(min(MiB, size - written))
            out.write(chunk)
            written += len(chunk)
            if written % (16 * MiB) == 0:
                tick(written)


def _copy(source: Path, dest: Path, tick: Callable[[int], None]) -> None:
    done = 0
    with source.open("rb") as src, dest.open("wb") as out:
        while chunk := src.read(COPY_CHUNK):
            out.write(chunk)
            done += len(chunk)
            tick(done)
    shutil.copystat(source, dest)
