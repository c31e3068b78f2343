"""The archive rewrite behind forks (belayer/sandbox/fork_archive.py), without podman:
a synthetic podman export whose configuration names the parent's paths."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from belayer.sandbox.compression import compressor, unpack
from belayer.sandbox.errors import CheckpointCorrupt
from belayer.sandbox.fork_archive import ForkIdentity, write_fork

PARENT = {"chan": "/run/belayer/sbx/sbx-parent"}
IDENTITY = ForkIdentity(parent_channel_dir=PARENT["chan"], channel_dir="/run/belayer/sbx/sbx-child",
                        hostname="sbx-child", labels={"belayer.sandbox": "sbx-child", "belayer.generation": "1"})  # fmt: skip


def spec() -> dict:
    return {"hostname": "sandbox", "mounts": [{"destination": "/run/belayer", "source": PARENT["chan"]}],
            "linux": {"namespaces": [{"type": "network"}, {"type": "user"}]}}  # fmt: skip


def export(path, *, long_name: bool = False) -> dict[str, bytes]:
    """A tar shaped like `podman container checkpoint --export`; returns its members."""
    members = {
        "config.dump": json.dumps({"spec": spec(), "name": "sbx-parent-g0", "labels": {"belayer.sandbox": "sbx-parent",
                                   "belayer.test": "t"}, "CreateCommand": [f"--volume={PARENT['chan']}:/run/belayer"]}).encode(),
        "checkpoint/pages-1.img": bytes(range(256)) * 41,  # not a multiple of 512
        "spec.dump": json.dumps(spec()).encode(),
        "rootfs-diff.tar": b"\0" * 1024,
    }  # fmt: skip
    if long_name:  # a PAX header before the member (names over 100 bytes)
        members["checkpoint/" + "x" * 150 + ".img"] = b"long"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT if long_name else tarfile.GNU_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return members


@pytest.mark.parametrize("long_name", [False, True])
def test_a_forks_archive_names_its_own_paths_and_keeps_every_other_byte(tmp_path, long_name):
    members = export(tmp_path / "plain.tar", long_name=long_name)
    write_fork(tmp_path / "plain.tar", tmp_path / "fork.tar", IDENTITY)
    with tarfile.open(tmp_path / "fork.tar") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert set(got) == set(members)
    for name, data in members.items():
        if name not in ("config.dump", "spec.dump"):
            assert got[name] == data, name
    config, spec_dump = json.loads(got["config.dump"]), json.loads(got["spec.dump"])
    for s in (config["spec"], spec_dump):
        assert s["hostname"] == "sbx-child"
        assert s["mounts"][0]["source"] == "/run/belayer/sbx/sbx-child"
        assert s["linux"]["namespaces"] == [
            {"type": "network"},
            {"type": "user"},
        ]  # made anew at each restore
    assert config["labels"] == {
        "belayer.sandbox": "sbx-child",
        "belayer.test": "t",
        "belayer.generation": "1",
    }
    assert "sbx-parent" not in got["config.dump"].decode().replace("sbx-parent-g0", "")


def downloading(path):
    """A download that writes `path` in small chunks, as the object store does."""

    def download(dest):
        data = path.read_bytes()
        for i in range(0, len(data), 4096):
            dest.write(data[i : i + 4096])

    return download


@pytest.mark.parametrize("method", ["zstd", "gzip"])
@pytest.mark.usefixtures("local_processes")
def test_unpack_decompresses_as_it_downloads_and_refuses_what_is_not_an_export(tmp_path, method):
    export(tmp_path / "plain.tar")
    packed = tmp_path / f"a.tar.{method}"
    with open(tmp_path / "plain.tar", "rb") as src, open(packed, "wb") as out:
        subprocess.run(compressor(method), stdin=src, stdout=out, check=True)
    plain = unpack(downloading(packed), method, tmp_path / "out.tar")
    assert plain.read_bytes() == (tmp_path / "plain.tar").read_bytes()
    assert (
        unpack(downloading(tmp_path / "plain.tar"), "none", tmp_path / "copy.tar").read_bytes()
        == (tmp_path / "plain.tar").read_bytes()
    )
    (tmp_path / "half").write_bytes(packed.read_bytes()[:40])
    with pytest.raises(CheckpointCorrupt, match=f"does not decompress as {method}"):
        unpack(downloading(tmp_path / "half"), method, tmp_path / "bad.tar")

    def refused(dest):
        dest.write(b"x" * 100)
        raise CheckpointCorrupt("sha256 mismatch")

    with pytest.raises(CheckpointCorrupt, match="sha256 mismatch"):
        unpack(refused, method, tmp_path / "refused.tar")
    with tarfile.open(tmp_path / "other.tar", "w") as tar:
        tar.addfile(tarfile.TarInfo("hello"), io.BytesIO(b""))
    with pytest.raises(CheckpointCorrupt, match="lacks config.dump, spec.dump"):
        write_fork(tmp_path / "other.tar", tmp_path / "fork.tar", IDENTITY)


def test_a_lineages_checkpoints_are_found_newest_first_up_to_a_step(tmp_path):
    from belayer.sandbox.checkpoints import checkpoints_at_or_before
    from belayer.sandbox.localstore import LocalDirStore
    from belayer.sandbox.models import CheckpointMeta

    store = LocalDirStore(tmp_path)
    for step, created in ((1, 10.0), (3, 30.0), (3, 31.0), (5, 50.0)):
        base = f"sandboxes/sbx-abcd/{step:08d}-g0-{int(created)}/"
        meta = CheckpointMeta(sandbox_id="sbx-abcd", trajectory="t", step=step, generation=0,
                              archive_key=base + "archive", archive_sha256=f"{created}", archive_bytes=1, image="i",
                              image_id="i", criu_version="4", podman_version="4", compression="zstd", netns="n",
                              channel_dir="c", created_at=created, dump_s=0.1)  # fmt: skip
        store.put_bytes(base + "meta.json", meta.model_dump_json().encode())
    store.put_bytes("sandboxes/sbx-abcd/00000002-g0-x/meta.json", b"not json")  # unreadable: skipped
    store.put_bytes("sandboxes/sbx-abcd/lineage/g0000000000.json", b"{}")
    found = checkpoints_at_or_before(store, "sandboxes/", "sbx-abcd", 4)
    assert [(r.step, r.archive_sha256) for r in found] == [(3, "31.0"), (3, "30.0"), (1, "10.0")]
    assert checkpoints_at_or_before(store, "sandboxes/", "sbx-other", 4) == []
