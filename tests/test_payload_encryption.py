"""Temporal payload encryption: the codec, the one data converter, and the codec server.

A workflow and its activities run on a real Temporal dev server with encryption on;
the raw history, read by a client without the codec, must not contain a known secret
anywhere (inputs, results, failure messages), and the same history decodes with the
key, both through the SDK and through `belayer codec-server`'s HTTP protocol.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.history.v1 import History
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel, SecretStr

    from belayer.config import TemporalConfig, load_config
    from belayer.errors import ConfigError
    from belayer.payload_codec import ENCODING, EncryptionCodec, PayloadDecryptError, derive_payload_key
    from belayer.stack.local import LocalStack
    from belayer.stack.services import TemporalDevServer, port_in_use, venv_binary
    from belayer.temporal_client import connect, data_converter
    from tests.conftest import free_port_block

SECRET = "hunter2-" + uuid.uuid4().hex  # fresh per run: cannot appear by accident
T = timedelta(seconds=30)


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


class EchoArgs(BaseModel):
    text: str


class EchoResult(BaseModel):
    text: str
    failure: str


@activity.defn(name="test.echo")
async def echo(args: EchoArgs) -> EchoResult:
    return EchoResult(text=args.text.upper(), failure="")


@activity.defn(name="test.fail")
async def fail(args: EchoArgs) -> EchoResult:
    raise ApplicationError(f"refused {args.text}", non_retryable=True, type="Refused")


@workflow.defn(name="EncryptedEcho")
class EncryptedEcho:
    @workflow.run
    async def run(self, args: EchoArgs) -> EchoResult:
        done = await workflow.execute_activity(echo, args, start_to_close_timeout=T)
        try:
            await workflow.execute_activity(
                fail, args, start_to_close_timeout=T, retry_policy=RetryPolicy(maximum_attempts=1)
            )
        except ActivityError as err:
            done.failure = str(err.cause)
        return done


# --- the codec alone -----------------------------------------------------------------


def plain_payload(text: str) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(text).encode())


def test_codec_round_trip_hides_the_plaintext_and_marks_the_payload():
    codec = EncryptionCodec.from_setting(SecretStr(new_key()))
    sealed = codec.encrypt(plain_payload(SECRET))
    assert SECRET.encode() not in sealed.SerializeToString()
    assert sealed.metadata["encoding"] == ENCODING
    assert sealed.metadata["encryption-key-id"] == codec.key_id.encode()
    assert codec.decrypt(sealed) == plain_payload(SECRET)
    assert codec.encrypt(plain_payload(SECRET)).data != sealed.data  # a fresh salt each time


def test_tampered_payload_is_refused():
    codec = EncryptionCodec.from_setting(new_key())
    sealed = codec.encrypt(plain_payload(SECRET))
    for position in (0, 5, len(sealed.data) // 2, len(sealed.data) - 1):
        bad = bytearray(sealed.data)
        bad[position] ^= 0x01
        with pytest.raises(PayloadDecryptError, match="fails authentication|unknown version"):
            codec.decrypt(Payload(metadata=sealed.metadata, data=bytes(bad)))
    with pytest.raises(PayloadDecryptError, match="truncated"):
        codec.decrypt(Payload(metadata=sealed.metadata, data=sealed.data[:20]))


def test_wrong_key_is_refused_even_with_a_forged_key_id():
    writer, reader = EncryptionCodec.from_setting(new_key()), EncryptionCodec.from_setting(new_key())
    sealed = writer.encrypt(plain_payload(SECRET))
    with pytest.raises(PayloadDecryptError, match=f"key id {writer.key_id}.*key id {reader.key_id}"):
        reader.decrypt(sealed)
    forged = Payload(
        metadata={**sealed.metadata, "encryption-key-id": reader.key_id.encode()}, data=sealed.data
    )
    with pytest.raises(PayloadDecryptError, match="fails authentication"):
        reader.decrypt(forged)


def test_payload_key_is_derived_apart_from_the_archive_key():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    master = os.urandom(32)
    archive_label = b"belayer checkpoint archive v1"
    archive = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=archive_label).derive(master)
    assert derive_payload_key(master) not in (master, archive)


def test_unencrypted_payload_is_refused_unless_old_histories_are_read():
    """Anyone who reaches Temporal can write a plaintext payload: an encrypting worker
    decodes only what its key sealed, and reads old plaintext histories only when told to."""
    key = new_key()
    with pytest.raises(PayloadDecryptError, match=r"not encrypted.*ACCEPT_PLAINTEXT_PAYLOADS"):
        EncryptionCodec.from_setting(key).decrypt(plain_payload("forged"))
    reading_old = EncryptionCodec.from_setting(key, accept_plaintext=True)
    assert reading_old.decrypt(plain_payload("old history")) == plain_payload("old history")
    converter = data_converter(TemporalConfig(encrypt_payloads=True, accept_plaintext_payloads=True), key)
    assert converter.payload_codec.accept_plaintext
    assert not data_converter(TemporalConfig(encrypt_payloads=True), key).payload_codec.accept_plaintext


def test_switch_without_key_names_both_settings():
    with pytest.raises(ConfigError, match=r"temporal\.encrypt_payloads.*storage\.encryption_key"):
        load_config(temporal={"encrypt_payloads": True})
    with pytest.raises(ConfigError, match=r"temporal\.encrypt_payloads.*storage\.encryption_key"):
        data_converter(TemporalConfig(encrypt_payloads=True), SecretStr(""))
    assert data_converter(TemporalConfig(), None).payload_codec is None  # off by default


def test_local_stack_points_the_web_ui_at_the_codec_server(tmp_path):
    config = load_config(
        state_dir=tmp_path,
        temporal={"encrypt_payloads": True, "codec_port": 18081},
        storage={"encryption_key": new_key()},
    )
    argv, _ = TemporalDevServer(config.temporal, tmp_path).command()
    assert argv[argv.index("--ui-codec-endpoint") + 1] == "http://127.0.0.1:18081"
    assert "codec-server" in [s.name for s in LocalStack(config).services]
    plain = load_config(state_dir=tmp_path)
    assert "--ui-codec-endpoint" not in TemporalDevServer(plain.temporal, tmp_path).command()[0]
    assert "codec-server" not in [s.name for s in LocalStack(plain).services]


# --- through a real Temporal dev server ------------------------------------------------


@pytest.fixture
def encrypted(stack_config):
    """The session's Temporal settings with payload encryption on, and a fresh key."""
    return stack_config.temporal.model_copy(update={"encrypt_payloads": True}), SecretStr(new_key())


async def run_encrypted_echo(temporal_cfg, key) -> tuple[EchoResult, str]:
    from temporalio.worker import Worker

    client = await connect(temporal_cfg, key)
    queue = f"encrypted-echo-{uuid.uuid4().hex[:8]}"
    workflow_id = f"encrypted-echo-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[EncryptedEcho], activities=[echo, fail]):
        result = await client.execute_workflow(
            EncryptedEcho.run,
            EchoArgs(text=SECRET),
            id=workflow_id,
            task_queue=queue,
            result_type=EchoResult,
            execution_timeout=timedelta(minutes=2),
        )
    return result, workflow_id


def history_payloads(message) -> list[Payload]:
    """Every Payload anywhere inside a protobuf message (history events nest them)."""
    found = []
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if hasattr(value, "ListFields"):
            values = [value]
        else:  # a repeated field, or a map (of Payloads, or of scalars skipped below)
            values = value.values() if hasattr(value, "values") else value
        for item in values:
            if isinstance(item, Payload):
                found.append(item)
            elif hasattr(item, "ListFields"):
                found.extend(history_payloads(item))
    return found


async def test_history_holds_no_plaintext_and_decodes_with_the_key(temporal_server, encrypted):
    temporal_cfg, key = encrypted
    result, workflow_id = await run_encrypted_echo(temporal_cfg, key)
    assert result.text == SECRET.upper()
    assert SECRET in result.failure  # the failure message came back decoded, through the codec

    bare = await connect(temporal_cfg.model_copy(update={"encrypt_payloads": False}))
    history = History(events=(await bare.get_workflow_handle(workflow_id).fetch_history()).events)
    raw = history.SerializeToString()
    assert SECRET.encode() not in raw and SECRET.upper().encode() not in raw
    payloads = history_payloads(history)
    # input, two activity inputs, a result, the failure, the workflow's result
    assert len(payloads) >= 6 and all(p.metadata["encoding"] == ENCODING for p in payloads)

    keyed = await connect(temporal_cfg, key)
    texts = [
        json.loads(p.data)
        for p in await keyed.data_converter.payload_codec.decode(payloads)
        if p.metadata.get("encoding") == b"json/plain"
    ]
    assert {"text": SECRET} in texts and any(t.get("text") == SECRET.upper() for t in texts)
    assert any(f"refused {SECRET}" in json.dumps(t) for t in texts)  # the encoded failure attributes

    wrong = await connect(temporal_cfg, SecretStr(new_key()))
    with pytest.raises(PayloadDecryptError, match="key id"):
        await wrong.data_converter.decode(payloads[:1])


async def test_without_encryption_the_same_history_shows_the_secret(temporal_server, stack_config):
    """The control: the plaintext check above can fail, and encryption is off by default."""
    _, workflow_id = await run_encrypted_echo(stack_config.temporal, None)
    bare = await connect(stack_config.temporal)
    history = History(events=(await bare.get_workflow_handle(workflow_id).fetch_history()).events)
    assert SECRET.encode() in history.SerializeToString()


# --- `belayer codec-server` over HTTP ----------------------------------------------------


@pytest.fixture
def codec_server_process(tmp_path):
    """`belayer codec-server` on a free port with a fresh key; stopped after the test."""
    (port,) = free_port_block(1, with_grpc=False)  # below the ephemeral range, where nothing else draws
    key = new_key()
    env = {**os.environ, "BELAYER_STORAGE__ENCRYPTION_KEY": key, "BELAYER_STATE_DIR": str(tmp_path)}
    env = {k: v for k, v in env.items() if not (k.startswith("BELAYER_TEMPORAL__") or k == "BELAYER_CONFIG")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "belayer.cli", "codec-server", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(150):
            if proc.poll() is not None:
                pytest.fail(f"codec-server exited: {proc.stdout.read().decode()}")
            if port_in_use("127.0.0.1", port):
                break
            time.sleep(0.1)
        else:
            pytest.fail("codec-server never listened")
        yield f"http://127.0.0.1:{port}", SecretStr(key)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        assert proc.returncode is not None, f"codec-server pid {proc.pid} leaked"


def call(url: str, *, method: str = "POST", body: dict | None = None, headers: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def cli_payload_bytes(output: bytes) -> bytes:
    """`temporal workflow show --output json`, with every payload's base64 data decoded."""
    import re

    datas = re.findall(rb'"data":\s*"([A-Za-z0-9+/=]+)"', output)
    return output + b"".join(base64.b64decode(d) for d in datas)


def as_json(payloads: list[Payload]) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(Payloads(payloads=payloads))


async def test_codec_server_decodes_real_history_payloads_for_the_web_ui(
    temporal_server, stack_config, codec_server_process
):
    from google.protobuf import json_format

    endpoint, key = codec_server_process
    temporal_cfg = stack_config.temporal.model_copy(update={"encrypt_payloads": True})
    _, workflow_id = await run_encrypted_echo(temporal_cfg, key)
    bare = await connect(temporal_cfg.model_copy(update={"encrypt_payloads": False}))
    encoded = history_payloads(
        History(events=(await bare.get_workflow_handle(workflow_id).fetch_history()).events)
    )
    ui = {"Origin": "http://127.0.0.1:8233", "X-Namespace": stack_config.temporal.namespace}

    status, headers, _ = call(
        f"{endpoint}/decode",
        method="OPTIONS",
        headers={
            "Origin": "http://127.0.0.1:8233",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-namespace",
        },
    )
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://127.0.0.1:8233"
    assert "X-Namespace" in headers["Access-Control-Allow-Headers"]
    assert "POST" in headers["Access-Control-Allow-Methods"]

    status, headers, body = call(f"{endpoint}/decode", body=as_json(encoded), headers=ui)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://127.0.0.1:8233"
    decoded = json_format.ParseDict(json.loads(body), Payloads()).payloads
    assert len(decoded) == len(encoded) and not any(p.metadata["encoding"] == ENCODING for p in decoded)
    assert any(SECRET.encode() in p.data for p in decoded)

    status, _, body = call(f"{endpoint}/encode", body=as_json(decoded[:1]), headers=ui)
    assert status == 200
    again = json_format.ParseDict(json.loads(body), Payloads()).payloads
    assert again[0].metadata["encoding"] == ENCODING and SECRET.encode() not in again[0].data

    tampered = Payload(
        metadata=encoded[0].metadata, data=encoded[0].data[:-1] + bytes([encoded[0].data[-1] ^ 1])
    )
    status, _, body = call(f"{endpoint}/decode", body=as_json([tampered]), headers=ui)
    assert status == 400 and b"fails authentication" in body

    temporal_cli = [
        str(venv_binary("temporal")),
        "workflow",
        "show",
        "-w",
        workflow_id,
        "--output",
        "json",
        "--address",
        temporal_cfg.address,
        "--namespace",
        temporal_cfg.namespace,
    ]
    shown = subprocess.run([*temporal_cli, "--codec-endpoint", endpoint], capture_output=True, timeout=60)
    assert shown.returncode == 0 and SECRET.encode() in cli_payload_bytes(shown.stdout), shown.stderr
    hidden = subprocess.run(temporal_cli, capture_output=True, timeout=60)
    assert hidden.returncode == 0 and SECRET.encode() not in cli_payload_bytes(hidden.stdout), hidden.stderr

    assert call(f"{endpoint}/decode", method="OPTIONS", headers={"Origin": "http://evil.example"})[0] == 403
    assert call(f"{endpoint}/decode", body=as_json(encoded), headers={**ui, "X-Namespace": "other"})[0] == 403
    assert call(f"{endpoint}/decode", body=as_json(encoded), headers={"Host": "evil.example"})[0] == 421


@pytest.mark.usefixtures("local_processes")
def test_belayer_up_serves_the_codec_to_the_web_ui(tmp_path):
    """`up` with encryption on: a healthy codec server, and a web UI that names it."""
    from tests.conftest import isolated_config

    base = isolated_config(tmp_path / "state")
    (port,) = free_port_block(1, with_grpc=False)
    config = base.model_copy(
        update={
            "temporal": base.temporal.model_copy(update={"encrypt_payloads": True, "codec_port": port}),
            "storage": base.storage.model_copy(update={"encryption_key": SecretStr(new_key())}),
        }
    )
    stack = LocalStack(config)
    stack.select(["temporal", "codec-server"])
    try:
        stack.up(wait=True)
        rows = {row.name: row for row in stack.status()}
        assert rows["codec-server"].healthy, rows["codec-server"].detail
        ui = f"http://127.0.0.1:{config.temporal.ui_port}/api/v1/settings"
        with urllib.request.urlopen(ui, timeout=10) as response:
            settings = json.loads(response.read())
        assert settings["Codec"]["Endpoint"] == f"http://127.0.0.1:{port}", settings.get("Codec")
    finally:
        stack.down()
        leaked = [s.name for s in stack.services if stack.process(s).running() is not None]
        assert not leaked, f"left running: {leaked}"
