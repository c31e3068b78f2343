"""The control plane refuses what it did not write (issue 35 §4), on the real stack.

Each test plays someone who can write where Belayer's own processes write -- a Temporal
client without the payload key, the bucket, a forged activity argument -- and checks
that Belayer refuses the forgery with a clear error before it acts on it: an unmarked
payload, an edited or moved `meta.json`, a file-system snapshot swapped under a
checkpoint, a sandbox id or a staged checkpoint that points outside its directory, and
SeaweedFS's own ports reached without going through S3.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import urllib.error
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError
from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    from belayer.payload_codec import PayloadDecryptError
    from belayer.sandbox.errors import CheckpointCorrupt, InvalidSandboxId
    from belayer.sandbox.models import Action, LoggedAction, SandboxHandle, StagedCheckpoint
    from belayer.storage.encryption import MAC_METADATA, EncryptedArchiveStore
    from belayer.temporal_client import connect

KEY = bytes(range(32))
T = timedelta(seconds=30)


def act(step: int, command: str, trajectory: str = "t-control-plane") -> Action:
    return Action(trajectory=trajectory, step=step, command=command, timeout_s=30)


# --- an unmarked payload ------------------------------------------------------------------


@activity.defn(name="control-plane.shout")
async def shout(text: str) -> str:
    return text.upper()


@workflow.defn(name="ControlPlaneShout")
class Shout:
    @workflow.run
    async def run(self, text: str) -> str:
        return await workflow.execute_activity(shout, text, start_to_close_timeout=T)


async def first_verdict(client, workflow_id: str):
    """The first event that decides the run: its first workflow task failing, or the run
    completing. Temporal retries a failed workflow task, so the run never ends by itself."""
    from temporalio.api.enums.v1 import EventType

    handle = client.get_workflow_handle(workflow_id)
    async for event in handle.fetch_history_events(wait_new_event=True):
        if event.event_type in (
            EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
        ):
            return event
    raise AssertionError(f"{workflow_id}: history ended without a verdict")


async def test_an_unmarked_payload_never_reaches_an_encrypting_workflow(temporal_server, stack_config):
    """A client without the key starts a workflow with a plaintext input: the encrypting
    worker refuses to decode it (its workflow task fails, naming the fix), the workflow
    code never sees it and schedules nothing."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.worker import Worker

    key = SecretStr(base64.b64encode(os.urandom(32)).decode())
    encrypted = stack_config.temporal.model_copy(update={"encrypt_payloads": True})
    keyed = await connect(encrypted, key)
    forger = await connect(stack_config.temporal)  # no codec: its payloads carry no marker
    queue = workflow_id = f"control-plane-{uuid.uuid4().hex[:8]}"
    async with Worker(keyed, task_queue=queue, workflows=[Shout], activities=[shout]):
        await forger.start_workflow(
            Shout.run, "forged", id=workflow_id, task_queue=queue, execution_timeout=timedelta(minutes=2)
        )
        try:
            verdict = await first_verdict(keyed, workflow_id)
        finally:
            await keyed.get_workflow_handle(workflow_id).terminate("test over")
    assert verdict.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED, verdict
    failure = verdict.workflow_task_failed_event_attributes.failure
    said = failure.message
    if failure.HasField("encoded_attributes"):  # the message itself travels encrypted
        [attributes] = await keyed.data_converter.payload_codec.decode([failure.encoded_attributes])
        said += attributes.data.decode()
    assert "payload is not encrypted" in said and "ACCEPT_PLAINTEXT_PAYLOADS" in said, said


# --- checkpoints: meta.json authenticated, the fs snapshot pinned ---------------------------


def rewrite_meta(store, meta_key: str, **changes) -> None:
    """What an attacker with write access to the bucket does: edit meta.json; the store's
    own sha256 record is rewritten with it, so only a MAC can tell."""
    meta = json.loads(store.get_bytes(meta_key))
    store.put_bytes(meta_key, json.dumps({**meta, **changes}).encode())


def test_an_edited_or_moved_meta_json_is_refused_and_never_restored(sandboxes):
    host = sandboxes.host
    inner = host.store
    host.store = EncryptedArchiveStore(inner, KEY)
    handle = sandboxes.create()
    host.exec(handle, act(1, "echo one > /workspace/f"))
    first = host.checkpoint(handle)
    host.exec(handle, act(2, "echo two > /workspace/f"))
    second = host.checkpoint(handle)
    assert MAC_METADATA in inner.head_metadata(first.meta_key)[1]
    containers = set(sandboxes.backend.containers_of(handle.sandbox_id))

    # An edit that would pass every other check: the token prefix cleared skips the
    # branch check (as for a drain's checkpoint).
    rewrite_meta(inner, first.meta_key, token_prefix_len=None, trajectory="forged")
    with pytest.raises(CheckpointCorrupt, match="carries no MAC"):
        host.restore(first, handle.generation + 1)
    # The genuine bytes and MAC of another checkpoint, copied over this one's meta.json.
    data, metadata = inner.get_bytes_and_metadata(second.meta_key)
    inner.put_bytes(first.meta_key, data, metadata=metadata)
    with pytest.raises(CheckpointCorrupt, match="fails authentication"):
        host.restore(
            first.model_copy(update={"archive_sha256": second.archive_sha256}), handle.generation + 1
        )
    assert set(sandboxes.backend.containers_of(handle.sandbox_id)) == containers  # nothing restored
    restored, _ = host.restore(second, handle.generation + 1)  # the untouched one still restores
    assert host.exec(restored, act(3, "cat /workspace/f")).stdout == "two\n"


def test_a_file_system_snapshot_swapped_under_a_checkpoint_is_refused(sandboxes):
    """Without a key (no MAC): meta.json pointed at another checkpoint's fs.tar. The
    workflow pinned the snapshot's sha256 in its ref, so the fs-only recovery refuses it
    and starts over from step 1 instead of restoring files of another step."""
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    for step, command in enumerate(["echo one > /workspace/f", "echo two > /workspace/f"], start=1):
        obs = host.exec(handle, act(step, command))
        log.append(
            LoggedAction(
                trajectory="t-control-plane", step=step, command=command, observation_sha256=obs.sha256
            )
        )
        if step == 1:
            old = host.load_meta(host.checkpoint(handle, fs_snapshot=True))
    ref = host.checkpoint(handle, fs_snapshot=True)
    assert ref.fs_sha256 == host.load_meta(ref).fs_sha256
    rewrite_meta(host.store, ref.meta_key, fs_key=old.fs_key, fs_sha256=old.fs_sha256)
    host.kill(handle)
    outcome = host.recover(handle, [ref], log, mode="fs-only")
    assert outcome.source == "replay-from-start", outcome
    assert any("another file-system snapshot" in note for note in outcome.notes), outcome.notes
    assert host.exec(outcome.handle, act(3, "cat /workspace/f")).stdout == "two\n"


def stored_meta(store, base: str, step: int, **fields) -> None:
    """A checkpoint's meta.json at `base`, as a capture writes it (through `store`)."""
    from belayer.sandbox.models import CheckpointMeta

    meta = CheckpointMeta(
        sandbox_id="sbx-abcd",
        trajectory="t",
        step=step,
        generation=0,
        archive_key=base + "archive",
        archive_sha256=f"{step}" * 64,
        archive_bytes=1,
        image="i",
        image_id="i",
        criu_version="4",
        podman_version="4",
        compression="zstd",
        netns="n",
        channel_dir="c",
        created_at=float(step),
        dump_s=0.1,
        **fields,
    )
    store.put_bytes(base + "meta.json", meta.model_dump_json().encode())


def test_a_branch_skips_a_meta_json_without_its_mac_and_pins_the_snapshot(storage_config):
    """Rebuilding a finished lineage's refs for a branch (belayer/sandbox/checkpoints.py)
    reads meta.json through the keyed store: one planted without the MAC is skipped, not
    an error that stops the branch, and each ref pins the file-system snapshot as the
    workflow's own refs do."""
    from belayer.sandbox.checkpoints import checkpoints_at_or_before
    from belayer.storage.store import ObjectStore

    with ObjectStore(storage_config) as inner:
        store = EncryptedArchiveStore(inner, KEY)
        stored_meta(store, "sandboxes/sbx-abcd/00000001-g0-1/", 1, fs_key="f", fs_sha256="e" * 64)
        stored_meta(inner, "sandboxes/sbx-abcd/00000002-g0-2/", 2)  # planted: no MAC
        found = checkpoints_at_or_before(store, "sandboxes/", "sbx-abcd", 3)
    assert [(ref.step, ref.fs_sha256) for ref in found] == [(1, "e" * 64)]


# --- sandbox ids and staged checkpoints that lead out of their directories --------------------


def test_every_model_refuses_a_traversal_sandbox_id():
    from belayer.activities.sandbox import CreateSandboxArgs
    from belayer.sandbox.drain import DrainRecord
    from belayer.sandbox.lineage import LineageRecord
    from belayer.sandbox.models import ForkTarget

    for bad in ("../x", "/etc", "a/../../b", "sbx-../../b", "sbx-abcd/.."):
        with pytest.raises(ValidationError):
            SandboxHandle(sandbox_id=bad, host_queue="q", generation=0, container="c")
        with pytest.raises(ValidationError):
            CreateSandboxArgs(sandbox_id=bad)
        with pytest.raises(ValidationError):
            ForkTarget(sandbox_id=bad, trajectory="t")
        with pytest.raises(ValidationError):
            LineageRecord(sandbox_id=bad, generation=0, host_queue="q", container="c", written_at=0)
        with pytest.raises(ValidationError):
            DrainRecord.model_validate(
                {
                    "sandbox_id": bad,
                    "generation": 0,
                    "host_queue": "q",
                    "checkpoint": {
                        "meta_key": "k",
                        "step": 0,
                        "archive_sha256": "0" * 64,
                        "archive_bytes": 0,
                    },
                }
            )


def test_a_traversal_sandbox_id_is_refused_before_anything_is_touched(sandboxes, tmp_path):
    """`remove` deletes a lineage's channel directory: with `../victim` it would delete a
    directory beside the channel root, with an absolute id any directory at all."""
    host = sandboxes.host
    token = sandboxes.token
    channel_root = Path(host.cfg.channel_root)
    victims = {
        "../{name}": channel_root.parent / f"victim-{token}",
        "sbx-abcd/../../{name}": channel_root.parent / f"victim-{token}",
        "{absolute}": tmp_path / "victim",
    }
    handle = sandboxes.create()
    try:
        for form, victim in victims.items():
            (victim / "keep").mkdir(parents=True, exist_ok=True)
            bad = form.format(name=victim.name, absolute=victim)
            with pytest.raises(InvalidSandboxId, match="refused"):
                host.remove(bad)
            with pytest.raises(InvalidSandboxId):
                host.exec(handle.model_copy(update={"sandbox_id": bad}), act(1, "true"))
            with pytest.raises(InvalidSandboxId):
                host.delete_checkpoints(bad)
            with pytest.raises(InvalidSandboxId):
                sandboxes.backend.channel_dir(bad)
            assert (victim / "keep").is_dir(), f"{bad!r} removed {victim}"
    finally:
        for victim in victims.values():
            if victim.exists():
                (victim / "keep").rmdir()
                victim.rmdir()
    assert host.exec(handle, act(1, "echo alive")).stdout == "alive\n"


def test_a_forged_staged_checkpoint_neither_uploads_nor_deletes_another_file(sandboxes, tmp_path):
    """A staged checkpoint crosses Temporal and names a local file, which publish uploads
    and then deletes: one naming any other file, or a key of another lineage, is refused."""
    host = sandboxes.host
    handle = sandboxes.create()
    staged = host.capture_checkpoint(handle)
    victim = tmp_path / "victim.tar"
    victim.write_bytes(b"not a checkpoint")
    forged = [
        staged.model_copy(update={"path": str(victim)}),
        staged.model_copy(update={"base_key": staged.base_key.replace(handle.sandbox_id, "sbx-other0")}),
        staged.model_copy(update={"base_key": staged.base_key + "../../sbx-other0/"}),
    ]
    for bad in forged:
        with pytest.raises(CheckpointCorrupt, match="refused"):
            host.publish_checkpoint(StagedCheckpoint.model_validate(bad.model_dump()))
    assert victim.read_bytes() == b"not a checkpoint"
    ref = host.publish_checkpoint(staged)  # the genuine one still publishes
    assert host.load_meta(ref).sandbox_id == handle.sandbox_id


def test_a_container_labelled_with_a_foreign_sandbox_id_does_not_stop_the_sweep(sandboxes, caplog):
    """A host's start-up sweep (`sweep_stale`) reads every container's sandbox label: one
    Belayer never made (someone's container with the label, a lineage record planted
    under it) is skipped with a log line, and the sweep still fences the lineages that
    moved to another host."""
    from belayer.sandbox import lineage
    from belayer.sandbox.podman import LABEL_SANDBOX

    host = sandboxes.host
    prefix = host.cfg.checkpoint_prefix
    moved = sandboxes.create()
    lineage.write(host.store, prefix, moved.sandbox_id, moved.generation + 1, "elsewhere", "elsewhere-g1")
    foreign, container = "not-belayer", f"foreign-{sandboxes.token}"
    host.store.put_bytes(
        lineage.record_key(prefix, foreign, 1),
        json.dumps(
            {
                "sandbox_id": foreign,
                "generation": 1,
                "host_queue": "elsewhere",
                "container": "c",
                "written_at": 0,
            }
        ).encode(),
    )
    sandboxes.backend.podman(
        "create", "--name", container, "--label", f"{LABEL_SANDBOX}={foreign}", host.cfg.image, "true"
    )
    try:
        with caplog.at_level("WARNING", logger="belayer.sandbox.host"):
            fenced = host.sweep_stale()
        assert fenced == [moved.container]
        assert any(
            foreign in record.getMessage() and "skipped" in record.getMessage() for record in caplog.records
        ), caplog.text
        assert sandboxes.backend.podman("container", "exists", container, check=False).returncode == 0
    finally:
        sandboxes.backend.podman("rm", "-f", container, check=False)


# --- SeaweedFS's own ports --------------------------------------------------------------------


def http(url: str, method: str = "GET", data: bytes | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, data=data), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def refused(port: int) -> bool:
    """True when nothing on the host's 127.0.0.1 accepts a connection to `port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def unix_http(path: Path, url: str, method: str = "GET", data: bytes | None = None) -> int:
    """The status of an HTTP request over the unix socket at `path` (the filer's)."""
    from http.client import HTTPConnection  # here: the workflow sandbox re-imports this module

    connection = HTTPConnection("localhost", timeout=10)
    connection.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # used instead of a TCP one
    try:
        connection.sock.settimeout(10)
        connection.sock.connect(str(path))
        connection.request(method, url, body=data)
        return connection.getresponse().status
    finally:
        connection.close()


def test_seaweedfs_takes_only_s3_with_credentials_from_the_host(seaweedfs, storage_config, stack_config):
    """From the host only the S3 API answers, and only with the credentials. The master's
    HTTP port checks no credentials at all (`/col/delete?collection=<bucket>` empties the
    bucket) and every gRPC port takes `weed shell` or any client: none of them, nor the
    volume server's or filer's HTTP port, accepts a connection outside SeaweedFS's own
    network (belayer/stack/private_net.py)."""
    from belayer.storage.store import open_store

    with open_store(storage_config, encrypted=False) as store:
        store.put_bytes("control-plane/secret", b"held-in-the-bucket")
    ports = stack_config.stack
    master = f"http://127.0.0.1:{ports.seaweedfs_master_port}"
    with pytest.raises(urllib.error.URLError) as err:
        http(master + "/cluster/status")
    assert isinstance(err.value.reason, ConnectionRefusedError), err.value
    internal = {
        "master": ports.seaweedfs_master_port,
        "volume": ports.seaweedfs_volume_port,
        "filer": ports.seaweedfs_filer_port,
    }
    reachable = [
        f"{name} {kind} {port + offset}"
        for name, port in internal.items()
        for kind, offset in (("http", 0), ("grpc", 10000))
        if not refused(port + offset)
    ]
    assert not reachable, f"reachable from the host without credentials: {reachable}"
    key = f"{storage_config.key_prefix}control-plane/secret"
    assert http(f"{storage_config.endpoint}/{storage_config.bucket}/{key}") == 403  # S3 without credentials
    with open_store(storage_config, encrypted=False) as store:
        assert store.get_bytes("control-plane/secret") == b"held-in-the-bucket"


def test_seaweedfs_filer_socket_refuses_requests_without_credentials(seaweedfs, storage_config):
    """The filer's local socket, in the data directory, is the one way to its HTTP API
    (which reads and writes any object by path) from outside SeaweedFS's network: it
    refuses an unsigned request (belayer/stack/services.py `jwt_signing_keys`)."""
    from belayer.storage.store import open_store

    with open_store(storage_config, encrypted=False) as store:
        store.put_bytes("control-plane/secret", b"held-in-the-bucket")
    filer = seaweedfs.service.data_dir / "filer.sock"
    path = f"/buckets/{storage_config.bucket}/{storage_config.key_prefix}control-plane/secret"
    assert unix_http(filer, path) == 401
    assert unix_http(filer, path, "PUT", b"forged") == 401
    assert unix_http(filer, f"/buckets/{storage_config.bucket}/") == 401
    with open_store(storage_config, encrypted=False) as store:
        assert store.get_bytes("control-plane/secret") == b"held-in-the-bucket"


def test_a_plaintext_payload_is_refused_by_the_codec_server_too(tmp_path):
    """The web UI's decoder follows the workers: an unmarked payload is an error there."""
    from temporalio.api.common.v1 import Payload

    from belayer.codec_server import make_server
    from belayer.config import load_config

    config = load_config(state_dir=tmp_path, storage={"encryption_key": base64.b64encode(KEY).decode()})
    server = make_server(config, port=0)
    try:
        with pytest.raises(PayloadDecryptError, match="not encrypted"):
            server.codec.decrypt(Payload(metadata={"encoding": b"json/plain"}, data=b'"forged"'))
    finally:
        server.server_close()
