"""A podman checkpoint archive made into the archive of a fork: another lineage's sandbox.

`podman container restore --import --name` restores one archive any number of times
under new names, but the archive's configuration still points at the parent's supervisor
channel directory: two forks would share one socket. So each fork gets its own copy of
the archive with `config.dump` and `spec.dump` rewritten: its channel path, its labels,
its hostname. (Each restore gets a network namespace of its own from CRIU: the sandboxes
run with `--network=none`, belayer/sandbox/podman.py.) Everything else -- CRIU images,
tmpfs contents, the rootfs diff -- is copied byte for byte with `copy_file_range` from
one uncompressed copy of the archive made once per host (`compression.unpack`), so a
fork costs a file copy in the page cache, not a decompression.

Why `--name` and not a rewritten name: podman then gives the fork a new container id
and its own state paths. The price: podman refuses `--name` with `--tcp-established`,
so a checkpoint holding an established TCP connection cannot be forked (the restore
fails and the group falls back to creating its sandboxes independently). Listening
sockets, the usual case between actions, fork fine.
"""

from __future__ import annotations

import copy
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from belayer.sandbox.errors import CheckpointCorrupt

BLOCK = 512
REWRITTEN = ("config.dump", "spec.dump")


@dataclass(frozen=True)
class ForkIdentity:
    """What differs between a fork and its parent inside the archive's configuration."""

    parent_channel_dir: str
    channel_dir: str
    hostname: str
    labels: dict[str, str]


def write_fork(plain: Path, out: Path, identity: ForkIdentity) -> None:
    """`plain` with its configuration rewritten for `identity`, written to `out`."""
    try:
        with tarfile.open(plain, "r:") as tar:
            members = tar.getmembers()
            configs = {m.name: tar.extractfile(m).read() for m in members if m.name in REWRITTEN}
    except (tarfile.TarError, OSError) as exc:
        raise CheckpointCorrupt(f"checkpoint archive {plain.name} is not a readable tar: {exc}") from exc
    missing = [name for name in REWRITTEN if name not in configs]
    if missing:
        raise CheckpointCorrupt(
            f"checkpoint archive {plain.name} lacks {', '.join(missing)}: not a podman export"
        )
    with open(plain, "rb") as src, open(out, "wb") as dst:
        for member in members:
            if member.name in configs:
                _write_member(dst, member, _rewritten(member.name, configs[member.name], identity))
            else:
                _copy_span(src, dst, member.offset, _padded_end(member) - member.offset)
        dst.write(b"\0" * (2 * BLOCK))  # end of archive


def _rewritten(name: str, data: bytes, identity: ForkIdentity) -> bytes:
    text = data.decode()
    # The path is a unique string (it embeds the parent's sandbox id): wherever podman
    # recorded it (mounts, the create command) it now names the fork's.
    text = text.replace(identity.parent_channel_dir, identity.channel_dir)
    config = json.loads(text)
    spec = config["spec"] if name == "config.dump" else config
    spec["hostname"] = identity.hostname
    if name == "config.dump":
        config["labels"] = {**config.get("labels", {}), **identity.labels}
    return json.dumps(config).encode()


def _write_member(dst, member: tarfile.TarInfo, data: bytes) -> None:
    info = copy.copy(member)
    info.size = len(data)
    dst.write(info.tobuf(format=tarfile.PAX_FORMAT))
    dst.write(data)
    dst.write(b"\0" * (-len(data) % BLOCK))


def _padded_end(member: tarfile.TarInfo) -> int:
    size = member.size if member.isreg() else 0
    return member.offset_data + size + (-size % BLOCK)


def _copy_span(src, dst, offset: int, length: int) -> None:
    dst.flush()
    src_fd, dst_fd = src.fileno(), dst.fileno()
    while length > 0:
        n = os.copy_file_range(src_fd, dst_fd, length, offset)
        if n == 0:
            raise CheckpointCorrupt("checkpoint archive ended inside a member: it is truncated")
        offset += n
        length -= n
    dst.seek(0, 2)
