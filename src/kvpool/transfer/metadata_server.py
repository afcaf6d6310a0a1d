"""The HTTP metadata service: a segment directory for hosts without etcd.

``PUT /v1/segments/<name>`` (JSON descriptor + ``ttl``; 409 if another owner holds the name),
``GET /v1/segments/<name>`` (404 when absent), ``DELETE /v1/segments/<name>``,
``GET /v1/segments`` (all), ``GET /health``. Errors are JSON ``{"error": {...}}``. Entries not
renewed within their ttl disappear. Standard-library HTTP server: one thread per request (at
most ``MAX_THREADS``; a request must arrive whole within ``REQUEST_TIMEOUT``).

With a cluster token every call but ``/health`` needs ``Authorization: Bearer <internal
bearer>`` (derived from the token: ``auth.internal_bearer``). PUT and DELETE carry the
publisher's owner key (``X-KVPool-Owner-Key``): only that key renews, replaces or withdraws
the entry. A published descriptor's host must be the address the request came from (or, from
loopback, an address of this host), so nobody publishes a segment in another host's name.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvpool.common import auth
from kvpool.common.errors import (
    AlreadyExistsError,
    AuthError,
    BadRequestError,
    KVPoolError,
    NotFoundError,
)
from kvpool.common.net import host_matches, is_loopback
from kvpool.transfer.descriptor_table import DescriptorTable
from kvpool.transfer.metadata import OWNER_KEY_HEADER
from kvpool.transfer.segment import SegmentDescriptor

logger = logging.getLogger(__name__)

MAX_BODY = 64 << 10
MAX_THREADS = 64
REQUEST_TIMEOUT = 10.0
PREFIX = "/v1/segments"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT  # a slow or silent client is dropped

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
            if urllib.parse.urlsplit(self.path).path != "/health":
                self._authorize()
            code, body = fn()
        except KVPoolError as exc:
            code, body = exc.http_status, exc.to_openai()
        except Exception:  # never let one request kill the service
            logger.exception("metadata service: %s %s failed", self.command, self.path)
            code, body = 500, KVPoolError("internal error").to_openai()
        self._send(code, body)

    def _authorize(self) -> None:
        expected = self.server.bearer
        given = self.headers.get("Authorization", "")
        if expected and not secrets.compare_digest(given.encode(), f"Bearer {expected}".encode()):
            raise AuthError("missing or wrong bearer token (the cluster token's internal bearer)")

    def _owner_key(self) -> str:
        key = self.headers.get(OWNER_KEY_HEADER, "")
        if not 16 <= len(key) <= 128:
            raise BadRequestError(f"{OWNER_KEY_HEADER} must be 16..128 characters")
        return key

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
            if not host_matches(desc.host, self.client_address[0]):
                raise BadRequestError(
                    f"descriptor host {desc.host!r} is not the address this request came from",
                    param="host",
                )
            try:
                self.server.table.put(desc, self._owner_key(), ttl)
            except AlreadyExistsError as exc:
                return 409, exc.to_openai()
            return 201, {"status": "ok"}

        self._handle(put)

    def do_DELETE(self) -> None:
        def delete():
            name, _ = self._name()
            if not self.server.table.delete(name, self._owner_key()):
                raise NotFoundError(f"segment {name!r} is not registered with this owner key")
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], token: str | None) -> None:
        super().__init__(addr, _Handler)
        self.table = DescriptorTable()
        self.bearer = auth.internal_bearer(token) if token else None
        self._slots = threading.BoundedSemaphore(MAX_THREADS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # too many at once: refuse this one
            logger.warning("metadata service: %d requests at once; refusing one", MAX_THREADS)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetadataServer:
    """Runs the service on a background thread; ``url`` is what engines put in ``directory``.
    ``token``: the cluster token (None: from the environment, ``""``: open, loopback only)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        token = auth.cluster_token(token)
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
