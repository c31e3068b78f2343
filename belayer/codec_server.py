"""`belayer codec-server`: Temporal's remote codec HTTP protocol over the payload codec.

The Temporal web UI (and `temporal workflow show --codec-endpoint`) sends encrypted
payloads here and shows what comes back: `POST /decode` and `POST /encode`, each with a
JSON `{"payloads": [...]}` body (`temporal.api.common.v1.Payloads` in protobuf's JSON
form) and the same shape in reply. Any path prefix is accepted (`/default/decode`), as
the protocol lets an endpoint carry `{namespace}`.

Whoever reaches this server can read every payload, so it listens on 127.0.0.1 only,
answers browsers only from the web UI's origin (CORS, preflight included), refuses
requests whose Host header is not its own address (a DNS-rebinding page cannot use it),
and serves only the configured namespace when the UI names one in `X-Namespace`.
The key stays in this process; nothing here logs payloads or the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from belayer.errors import BelayerError, ConfigError, StackError
from belayer.payload_codec import EncryptionCodec, PayloadDecryptError

HOST = "127.0.0.1"
MAX_BODY_BYTES = 64 << 20  # Temporal caps a payload blob well below this
ALLOWED_HEADERS = "Content-Type, X-Namespace, Authorization"


def ui_origins(ui_host: str, ui_port: int) -> list[str]:
    """The origins the local web UI is served from (both loopback spellings)."""
    hosts = {ui_host, "127.0.0.1", "localhost"} if ui_host in ("127.0.0.1", "localhost") else {ui_host}
    return sorted(f"http://{h}:{ui_port}" for h in hosts)


class CodecServer(ThreadingHTTPServer):
    """An HTTP server bound to 127.0.0.1 that encodes and decodes with `codec`."""

    daemon_threads = True

    def __init__(self, codec: EncryptionCodec, *, port: int, origins: Iterable[str], namespace: str):
        self.codec = codec
        self.origins = frozenset(origins)
        self.namespace = namespace
        super().__init__((HOST, port), _Handler)
        self.hosts = frozenset({f"{HOST}:{self.port}", f"localhost:{self.port}"})

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def endpoint(self) -> str:
        """What to give the web UI (`--ui-codec-endpoint`) or the CLI (`--codec-endpoint`)."""
        return f"http://{HOST}:{self.port}"


class _Handler(BaseHTTPRequestHandler):
    server: CodecServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002  (the stdlib's name)
        pass  # request lines name nothing secret, but the default prints every one to stderr

    def do_OPTIONS(self) -> None:
        if not self._host_ok():
            return
        origin = self.headers.get("Origin")
        if origin not in self.server.origins:
            self._reply(403, {"error": f"origin {origin!r} is not the Temporal web UI's"})
            return
        self._reply(
            204,
            None,
            extra={
                "Access-Control-Allow-Methods": "POST, OPTIONS",
                "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                "Access-Control-Max-Age": "600",
            },
        )

    def do_POST(self) -> None:
        if not self._host_ok():
            return
        action = self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        if action not in ("encode", "decode"):
            self._reply(404, {"error": "POST /encode or /decode"})
            return
        origin = self.headers.get("Origin")
        if origin is not None and origin not in self.server.origins:
            self._reply(403, {"error": f"origin {origin!r} is not the Temporal web UI's"})
            return
        namespace = self.headers.get("X-Namespace")
        if namespace and namespace != self.server.namespace:
            self._reply(
                403,
                {"error": f"this codec server serves namespace {self.server.namespace!r}, not {namespace!r}"},
            )
            return
        try:
            payloads = self._read_payloads()
            codec = self.server.codec
            convert = codec.encrypt if action == "encode" else codec.decrypt
            out = Payloads(payloads=[convert(p) for p in payloads.payloads])
        except (PayloadDecryptError, _BadRequest) as exc:
            self._reply(400, {"error": str(exc)})
            return
        self._reply(200, json_format.MessageToDict(out))

    def _read_payloads(self) -> Payloads:
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if content_type != "application/json":
            raise _BadRequest("send Content-Type: application/json")
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY_BYTES:
            raise _BadRequest(f"a body of 1 to {MAX_BODY_BYTES} bytes with Content-Length is required")
        body = self.rfile.read(length)
        try:
            return json_format.Parse(body, Payloads())
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            raise _BadRequest(f"body is not a Payloads JSON object: {exc}") from None

    def _host_ok(self) -> bool:
        if self.headers.get("Host") in self.server.hosts:
            return True
        self._reply(421, {"error": "Host header must be this server's own loopback address"})
        return False

    def _reply(self, status: int, body: dict | None, extra: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        origin = self.headers.get("Origin")
        if origin in self.server.origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Allow-Credentials", "true")
            self.send_header("Vary", "Origin")
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _BadRequest(BelayerError):
    """The request is not the codec protocol's."""


def make_server(config, port: int | None = None) -> CodecServer:
    """A codec server for `config` (a BelayerConfig): its key, namespace and UI origin."""
    if not config.storage.encryption_key.get_secret_value():
        raise ConfigError(
            "the codec server decodes with storage.encryption_key, which is empty; set "
            "BELAYER_STORAGE__ENCRYPTION_KEY (or `storage.encryption_key` in the config file) to "
            "the key the workers use"
        )
    codec = EncryptionCodec.from_setting(
        config.storage.encryption_key, accept_plaintext=config.temporal.accept_plaintext_payloads
    )
    ui_host = config.temporal.address.rpartition(":")[0] or HOST
    port = config.temporal.codec_port if port is None else port
    try:
        return CodecServer(
            codec,
            port=port,
            origins=ui_origins(ui_host, config.temporal.ui_port),
            namespace=config.temporal.namespace,
        )
    except OSError as exc:
        raise StackError(
            f"the codec server cannot listen on {HOST}:{port} ({exc}); pass --port or set "
            "BELAYER_TEMPORAL__CODEC_PORT to a free port"
        ) from None
