"""A small etcd v3 client over etcd's JSON gateway (``/v3/...``), standard library only.

Keys and values are bytes on the wire (base64 in JSON). Covers what kvpool needs: put/get,
prefix range and delete, leases (grant, keep-alive, revoke) and a create-if-absent
transaction (the building block of leader election). Several endpoints may be given; the next
one is tried when one is unreachable.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.error
import urllib.request

from kvpool.common.errors import KVPoolError

logger = logging.getLogger(__name__)


class EtcdError(KVPoolError):
    http_status = 503
    error_type = "etcd_error"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdClient:
    """Talks to one etcd cluster through the endpoints ``["127.0.0.1:2379", ...]``."""

    def __init__(self, endpoints: list[str] | str, timeout: float = 5.0) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint HOST:PORT")
        self.endpoints = [e if "://" in e else f"http://{e}" for e in endpoints]
        self.timeout = timeout

    def _call(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        last: Exception | None = None
        for i, base in enumerate(list(self.endpoints)):
            req = urllib.request.Request(
                f"{base}/v3/{path}", data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    out = json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                raise EtcdError(f"etcd {path}: HTTP {exc.code}: {detail}") from exc
            except (OSError, ValueError) as exc:
                last = exc
                continue
            if i:  # remember the endpoint that answered
                self.endpoints.insert(0, self.endpoints.pop(i))
            return out
        raise EtcdError(f"etcd unreachable at {', '.join(self.endpoints)}: {last}")

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self._call("kv/put", body)

    def get(self, key: bytes) -> bytes | None:
        kvs = self._call("kv/range", {"key": _b64(key)}).get("kvs") or []
        return _unb64(kvs[0].get("value")) if kvs else None

    def get_prefix(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        kvs = self._call("kv/range", body).get("kvs") or []
        return [(_unb64(kv.get("key")), _unb64(kv.get("value"))) for kv in kvs]

    def delete(self, key: bytes) -> int:
        return int(self._call("kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: bytes) -> int:
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        return int(self._call("kv/deleterange", body).get("deleted", 0))

    def lease_grant(self, ttl: float) -> int:
        out = self._call("lease/grant", {"TTL": max(1, round(ttl))})
        if "ID" not in out:
            raise EtcdError(f"etcd refused a lease: {out}")
        return int(out["ID"])

    def lease_keepalive(self, lease: int) -> int:
        """Renew a lease; the remaining TTL, 0 when the lease has already expired."""
        out = self._call("lease/keepalive", {"ID": str(lease)})
        return int((out.get("result") or {}).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        try:
            self._call("lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:  # already expired is fine
            logger.debug("etcd lease revoke: %s", exc)

    def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Put ``key`` only if it does not exist; True if this call created it."""
        put: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        body = {
            "compare": [
                {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            ],
            "success": [{"request_put": put}],
        }
        return bool(self._call("kv/txn", body).get("succeeded", False))


class Registration:
    """Keeps ``key = value`` in etcd under a lease renewed in the background (membership).

    The key vanishes ``ttl`` seconds after this process stops renewing it (crash, SIGKILL);
    ``close()`` deletes it at once. A lost lease (etcd restarted, a long pause) is re-granted.
    """

    def __init__(self, etcd: EtcdClient, key: bytes, value: bytes, ttl: float = 5.0) -> None:
        self.etcd, self.key, self.value, self.ttl = etcd, key, value, ttl
        self._lease = 0
        self._stop = threading.Event()
        self._register()
        self._thread = threading.Thread(target=self._renew, name="kvpool-etcd-reg", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        self._lease = self.etcd.lease_grant(self.ttl)
        self.etcd.put(self.key, self.value, self._lease)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.etcd.lease_keepalive(self._lease) <= 0:
                    logger.warning("etcd lease of %s expired; registering again", self.key)
                    self._register()
            except EtcdError as exc:
                logger.warning("etcd: renewing %s failed: %s", self.key, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.etcd.lease_revoke(self._lease)
