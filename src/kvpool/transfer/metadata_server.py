"""The HTTP metadata service: a segment directory for hosts without etcd.

``PUT /v1/segments/<name>`` (JSON descriptor + ``ttl``; 409 if another owner holds the name),
``GET /v1/segments/<name>`` (404 when absent), ``DELETE /v1/segments/<name>?owner=<id>``,
``GET /v1/segments`` (all), ``GET /health``. Errors are JSON ``{"error": {...}}``. Entries not
renewed within their ttl disappear. Standard-library HTTP server: one thread per request.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvpool.common.errors import AlreadyExistsError, BadRequestError, KVPoolError, NotFoundError
from kvpool.common.net import is_loopback
from kvpool.transfer.metadata import DescriptorTable
from kvpool.transfer.segment import SegmentDescriptor

logger = logging.getLogger(__name__)

MAX_BODY = 64 << 10
PREFIX = "/v1/segments"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:
        logger.debug("metadata %s: " + fmt, self.client_address[0], *args)

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, fn) -> None:
        try:
            self._authorize()
            code, body = fn()
        except KVPoolError as exc:
            code, body = exc.http_status, exc.to_openai()
        except Exception as exc:  # never let one request kill the service
            logger.exception("metadata service: %s %s failed", self.command, self.path)
            code, body = 500, KVPoolError(f"internal error: {exc}").to_openai()
        self._send(code, body)

    def _authorize(self) -> None:
        token = self.server.token
        if token and self.headers.get("Authorization") != f"Bearer {token}":
            err = KVPoolError("missing or wrong bearer token")
            err.http_status = 401
            raise err

    def _name(self) -> tuple[str, dict]:
        url = urllib.parse.urlsplit(self.path)
        if not url.path.startswith(PREFIX + "/") or len(url.path) == len(PREFIX) + 1:
            raise NotFoundError(f"no such resource {url.path}")
        return urllib.parse.unquote(url.path[len(PREFIX) + 1 :]), urllib.parse.parse_qs(url.query)

    def do_GET(self) -> None:
        def get():
            path = urllib.parse.urlsplit(self.path).path
            if path == "/health":
                return 200, {"status": "ok"}
            if path == PREFIX:
                return 200, {"segments": [d.to_dict() for d in self.server.table.all()]}
            name, _ = self._name()
            desc = self.server.table.get(name)
            if desc is None:
                raise NotFoundError(f"segment {name!r} not found")
            return 200, desc.to_dict()

        self._handle(get)

    def do_PUT(self) -> None:
        def put():
            name, _ = self._name()
            body = self._json_body()
            ttl = body.pop("ttl", None)
            if ttl is not None and not (isinstance(ttl, int | float) and 0 < ttl <= 3600):
                raise BadRequestError("ttl must be a number of seconds in (0, 3600]")
            desc = SegmentDescriptor.from_dict(body)
            if desc.name != name:
                raise BadRequestError("descriptor name differs from the URL")
            _check_types(desc)
            try:
                self.server.table.put(desc, ttl)
            except AlreadyExistsError as exc:
                return 409, exc.to_openai()
            return 201, {"status": "ok"}

        self._handle(put)

    def do_DELETE(self) -> None:
        def delete():
            name, query = self._name()
            owner = (query.get("owner") or [""])[0]
            if not self.server.table.delete(name, owner):
                raise NotFoundError(f"segment {name!r} not registered by owner {owner!r}")
            return 200, {"status": "ok"}

        self._handle(delete)

    def _json_body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError as exc:
            raise BadRequestError("bad Content-Length") from exc
        if not 0 < length <= MAX_BODY:
            raise BadRequestError(f"body must be 1..{MAX_BODY} bytes")
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError as exc:
            raise BadRequestError(f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequestError("body must be a JSON object")
        return body


def _check_types(desc: SegmentDescriptor) -> None:
    for field, kind in (("size", int), ("port", int), ("segment_id", int), ("pid", int)):
        value = getattr(desc, field)
        if not isinstance(value, kind) or isinstance(value, bool) or value < 0:
            raise BadRequestError(f"descriptor field {field} must be a non-negative integer")
    for field in ("name", "host", "owner_id", "boot_id"):
        if not isinstance(getattr(desc, field), str) or not getattr(desc, field):
            raise BadRequestError(f"descriptor field {field} must be a non-empty string")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], token: str | None) -> None:
        super().__init__(addr, _Handler)
        self.table = DescriptorTable()
        self.token = token


class MetadataServer:
    """Runs the service on a background thread; ``url`` is what engines put in ``directory``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(f"binding {host} (not loopback) requires KVPOOL_AUTH_TOKEN")
        self._server = _Server((host, port), token)
        self.host = host
        self.port = self._server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvpool-metadata", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
