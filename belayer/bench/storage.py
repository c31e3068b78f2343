"""`belayer bench storage`: object store throughput next to a local disk copy, same run.

One file of random bytes is copied on local disk (the baseline), uploaded through
`ObjectStore.upload_stream` and downloaded through `ObjectStore.download_stream`
(both sha256-verified, exactly the checkpoint path). MB here means MiB (2**20 bytes).
The local copy goes through the page cache without fsync, as SeaweedFS's writes do.
Everything the bench creates (temp files, the object) is removed, even on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from belayer.bench.machine import machine_load
from belayer.config import load_config
from belayer.storage.config import StorageConfig
from belayer.storage.store import ObjectStore

MiB = 1 << 20
COPY_CHUNK = 16 * MiB


@click.command("storage")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--size-mb", type=click.IntRange(1, 65536), default=256, show_default=True, help="File size in MiB."
)
@click.option(
    "--dir",
    "work_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the local files go (default: the system temp directory).",
)
@click.pass_context
def storage(ctx: click.Context, as_json: bool, size_mb: int, work_dir: Path | None) -> None:
    """Upload and download MB/s through the object store, against a local disk copy."""
    config_file = (ctx.obj or {}).get("config_file")
    cfg = load_config(config_file).storage
    result = run_storage_bench(cfg, size_mb=size_mb, work_dir=work_dir, console=Console(stderr=True))
    result["machine"] = machine_load()
    if as_json:
        click.echo(json.dumps(result))
    else:
        Console().print(result_table(result))


def run_storage_bench(
    cfg: StorageConfig, *, size_mb: int, work_dir: Path | None = None, console: Console | None = None
) -> dict:
    """Measure; returns the figures as a dict (the JSON the command prints)."""
    size = size_mb * MiB
    key = f"bench/storage-{uuid.uuid4().hex}"
    console = console or Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="belayer-bench-", dir=work_dir) as tmp, ObjectStore(cfg) as store:
        store.check()  # fail before writing a large file when endpoint, bucket or keys are wrong
        source, local_copy, downloaded = (Path(tmp) / name for name in ("source", "copy", "downloaded"))
        try:
            with _progress(console) as progress:
                _timed(progress, "write source", size, lambda tick: _write_random(source, size, tick))
                local_s = _timed(progress, "local copy", size, lambda tick: _copy(source, local_copy, tick))
                local_copy.unlink()
                with source.open("rb") as src:
                    upload_s = _timed(
                        progress, "upload", size, lambda tick: store.upload_stream(key, src, progress=tick)
                    )
                with downloaded.open("wb") as dest:
                    download_s = _timed(
                        progress,
                        "download",
                        size,
                        lambda tick: store.download_stream(key, dest, progress=tick),
                    )
        finally:
            store.delete(key)
    upload, download, local = size_mb / upload_s, size_mb / download_s, size_mb / local_s
    return {
        "size_mb": size_mb,
        "part_size_mb": cfg.part_size_mb,
        "endpoint": cfg.endpoint,
        "upload_mb_s": round(upload, 1),
        "download_mb_s": round(download, 1),
        "local_copy_mb_s": round(local, 1),
        "upload_vs_local": round(upload / local, 3),
        "download_vs_local": round(download / local, 3),
    }


def result_table(result: dict) -> Table:
    table = Table(title=f"storage bench: {result['size_mb']} MiB via {result['endpoint']}")
    table.add_column("path")
    table.add_column("MB/s", justify="right")
    table.add_column("vs local copy", justify="right")
    table.add_row("local disk copy", f"{result['local_copy_mb_s']:.1f}", "1.000")
    table.add_row("upload (verified)", f"{result['upload_mb_s']:.1f}", f"{result['upload_vs_local']:.3f}")
    table.add_row(
        "download (verified)", f"{result['download_mb_s']:.1f}", f"{result['download_vs_local']:.3f}"
    )
    return table


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<12}"),
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
