"""Checkpoint archives compressed outside the frozen window, with every core of the host.

podman can compress its own export (`checkpoint -c zstd`), but it does so on one core
and its import decompresses at ~160 MB/s here: 0.4 s of each checkpoint and 0.55 s of
each restore of the overhead bench's 85 MB archive. So podman writes a plain archive and
Belayer pipes it through the `zstd` CLI (level 1, `-T0`: one thread per core; 0.24 s
for the same archive on 2 cores, a smaller result than podman's), and a restore
decompresses with `zstd -d` as the archive downloads, before podman imports a plain tar. The stored
format is unchanged -- a compressed tar, as `meta.compression` says -- so checkpoints
written by podman's own compression restore the same way.

`none` stores the plain archive: the better choice when the link to the object store
is faster than compression (well above 300 MB/s here).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from belayer.sandbox.errors import CheckpointCorrupt, CheckpointFailed, SandboxError

COMPRESS = {"zstd": ["zstd", "-q", "-1", "-T0", "-c"], "gzip": ["gzip", "-1", "-c"]}
DECOMPRESS = {"zstd": ["zstd", "-d", "-q", "-c"], "gzip": ["gzip", "-d", "-c"]}


def compressor(compression: str) -> list[str] | None:
    """The command that compresses stdin to stdout for `compression`; None for `none`."""
    if compression == "none":
        return None
    tool = COMPRESS.get(compression)
    if tool is None:
        raise SandboxError(f"checkpoint compression {compression!r}: choose zstd, gzip or none")
    _require(tool[0], SandboxError)
    return tool


@contextlib.contextmanager
def compressed(path: Path, compression: str, chunk: int = 1 << 20) -> Iterator[Iterator[bytes]]:
    """The file at `path` as a stream of `compression`'s output chunks; the compressor's
    failure raises `CheckpointFailed` once the stream has ended."""
    tool = compressor(compression)
    with open(path, "rb") as source:
        if tool is None:
            yield iter(lambda: source.read(chunk), b"")
            return
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(tool, stdin=source, stdout=subprocess.PIPE, stderr=err)
            try:
                yield iter(lambda: proc.stdout.read(chunk), b"")
                proc.stdout.read()  # whatever the consumer left
                returncode = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            finally:
                proc.stdout.close()
            if returncode != 0:
                err.seek(0)
                raise CheckpointFailed(
                    f"`{' '.join(tool)}` failed on {path.name} (exit {returncode}): "
                    f"{err.read().decode(errors='replace')[-300:]}"
                )


def unpack(download: Callable[[BinaryIO], None], compression: str, dest: Path) -> Path:
    """The archive that `download` writes, decompressed as it arrives into a plain tar at
    `dest`. `download` checks the archive's sha256 and raises when it does not match; so
    does this then, and `dest` is the caller's to discard."""
    if compression == "none":
        with open(dest, "wb") as out:
            download(out)
        return dest
    tool = DECOMPRESS.get(compression)
    if tool is None:
        raise CheckpointCorrupt(f"checkpoint compression {compression!r} is not one Belayer writes")
    _require(tool[0], CheckpointCorrupt)
    with open(dest, "wb") as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(tool, stdin=subprocess.PIPE, stdout=out, stderr=err)
        try:
            with proc.stdin:
                download(proc.stdin)
        except BrokenPipeError:
            pass  # the tool stopped reading: its exit status and message say why
        except BaseException:
            proc.kill()
            raise
        finally:
            returncode = proc.wait()
        if returncode != 0:
            err.seek(0)
            message = err.read().decode(errors="replace")[-300:]
            raise CheckpointCorrupt(
                f"{dest.name}: the archive does not decompress as {compression}: {message}"
            )
    return dest


def _require(tool: str, error: type[SandboxError]) -> None:
    if shutil.which(tool) is None:
        raise error(f"`{tool}` is not installed: run infra/install/podman.sh as root")
