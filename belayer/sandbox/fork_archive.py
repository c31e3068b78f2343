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
and its own state paths. The price: podman refuses `--name` with `--tcp-established`.
Nor could two forks own one connection anyway: a checkpoint holding established TCP
connections is forked with them closed (their ends see a reset, as after a network blip;
listening sockets, the usual case between actions, come along). podman 4.3 has no
`--tcp-close`, so the fork's archive names another CRIU configuration, CRIU's own plus
`tcp-close` (`runtime.fork_criu_config`); the fork's own later checkpoints carry that name,
and their restores name the usual configuration again (`with_criu_config`), so the
connections the fork opens later survive its restores as any sandbox's do.
"""

from __future__ import annotations

import copy
import json
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from belayer.sandbox.errors import CheckpointCorrupt

BLOCK = 512
REWRITTEN = ("config.dump", "spec.dump")
CRIU_CONFIG_ANNOTATION = "org.criu.config"  # runc hands the file it names to CRIU


@dataclass(frozen=True)
class ForkIdentity:
    """What differs between a fork and its parent inside the archive's configuration."""

    parent_channel_dir: str
    channel_dir: str
    hostname: str
    labels: dict[str, str]
    criu_config: str | None = None  # another CRIU configuration for the fork's restore (and after)


def write_fork(plain: Path, out: Path, identity: ForkIdentity) -> None:
    """`plain` with its configuration rewritten for `identity`, written to `out`."""
    _write_rewritten(plain, out, lambda name, data: _rewritten(name, data, identity))


def criu_config_of(plain: Path) -> str | None:
    """The CRIU configuration the archive's container names (`org.criu.config`)."""
    spec = json.loads(_configs(plain)["spec.dump"])
    return spec.get("annotations", {}).get(CRIU_CONFIG_ANNOTATION)


def with_criu_config(plain: Path, out: Path, criu_config: str) -> None:
    """`plain` naming another CRIU configuration, written to `out`; nothing else changes."""

    def edit(name: str, data: bytes) -> bytes:
        config = json.loads(data)
        spec = config["spec"] if name == "config.dump" else config
        spec.setdefault("annotations", {})[CRIU_CONFIG_ANNOTATION] = criu_config
        return json.dumps(config).encode()

    _write_rewritten(plain, out, edit)


def _configs(plain: Path) -> dict[str, bytes]:
    try:
        with tarfile.open(plain, "r:") as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name in REWRITTEN}
    except (tarfile.TarError, OSError) as exc:
        raise CheckpointCorrupt(f"checkpoint archive {plain.name} is not a readable tar: {exc}") from exc


def _write_rewritten(plain: Path, out: Path, edit: Callable[[str, bytes], bytes]) -> None:
    """`plain` copied to `out` with `config.dump` and `spec.dump` passed through `edit`."""
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
                _write_member(dst, member, edit(member.name, configs[member.name]))
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
    if identity.criu_config is not None:
        spec.setdefault("annotations", {})[CRIU_CONFIG_ANNOTATION] = identity.criu_config
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
