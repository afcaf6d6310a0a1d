"""The segment directory: where engines publish segment descriptors and find each other's.

One interface, four backends, chosen by URL (``TransferConfig.directory``):

- ``memory``: a dictionary shared by every engine of this process (single-process use, tests);
- ``rpc://HOST:PORT``: the directory an RpcServer serves (``directory_service.py``): the store
  master's, the default of everything that talks to a store master;
- ``http://HOST:PORT``: the small metadata service of ``metadata_server.py``;
- ``etcd://HOST:PORT[,HOST:PORT]``: etcd, for several hosts; descriptors live under
  ``/kvpool/segments/<name>`` attached to the owner's lease, so a dead owner's segments vanish
  when its lease expires.

Owners keep their entries alive (the HTTP service and etcd drop entries not renewed within
``ttl``); a name held by another live owner is refused with ``AlreadyExistsError``, and the
name of a dead owner (a restarted worker's) is handed over. Each directory client has a secret
*owner key*: only the holder of the key an entry was published with may renew, replace or
withdraw it (the owner id is public: it travels in every descriptor). Descriptors are
validated when published and when read (``SegmentDescriptor.from_dict``).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod

from kvpool.common import auth
from kvpool.common.errors import AlreadyExistsError, BadRequestError, KVPoolError
from kvpool.common.etcd import EtcdClient, EtcdError
from kvpool.transfer.descriptor_table import DescriptorTable
from kvpool.transfer.segment import SegmentDescriptor, owner_is_dead

logger = logging.getLogger(__name__)

ETCD_PREFIX = b"/kvpool/segments/"
OWNER_KEY_HEADER = "X-KVPool-Owner-Key"


class SegmentDirectory(ABC):
    """Publishes this process's descriptors and looks up anyone's."""

    def __init__(self, ttl: float = 10.0) -> None:
        self.ttl = ttl
        self.owner_key = secrets.token_hex(16)  # proves our entries are ours (never listed)
        self._own: dict[str, SegmentDescriptor] = {}
        self._own_lock = threading.Lock()
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def publish(self, desc: SegmentDescriptor) -> None:
        self._put(desc)
        with self._own_lock:
            self._own[desc.name] = desc
        self._start_refresher()

    def withdraw(self, name: str) -> None:
        with self._own_lock:
            desc = self._own.pop(name, None)
        if desc is not None:
            self._delete(desc)

    @abstractmethod
    def lookup(self, name: str) -> SegmentDescriptor | None: ...

    @abstractmethod
    def list(self) -> list[SegmentDescriptor]: ...

    @abstractmethod
    def _put(self, desc: SegmentDescriptor) -> None: ...

    @abstractmethod
    def _delete(self, desc: SegmentDescriptor) -> None: ...

    def _refresh(self) -> None:  # noqa: B027 - backends with expiring entries override
        """Renew this process's entries (called every ttl/3)."""

    def close(self) -> None:
        """Withdraw every own descriptor and stop renewing."""
        self._stop.set()
        with self._own_lock:
            names = list(self._own)
        for name in names:
            try:
                self.withdraw(name)
            except KVPoolError as exc:
                logger.warning("directory: could not withdraw %s: %s", name, exc)

    def _start_refresher(self) -> None:
        if self._refresher is None and type(self)._refresh is not SegmentDirectory._refresh:
            self._refresher = threading.Thread(
                target=self._refresh_loop, name="kvpool-directory-refresh", daemon=True
            )
            self._refresher.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._refresh()
            except KVPoolError as exc:
                logger.warning("directory: renewing entries failed: %s", exc)

    def _own_descriptors(self) -> list[SegmentDescriptor]:
        with self._own_lock:
            return list(self._own.values())


_PROCESS_TABLE = DescriptorTable()


class InProcessDirectory(SegmentDirectory):
    """A table shared by every engine of this process (closing withdraws only its own)."""

    def __init__(self, table: DescriptorTable | None = None) -> None:
        super().__init__()
        self._table = table if table is not None else _PROCESS_TABLE

    def _put(self, desc: SegmentDescriptor) -> None:
        self._table.put(desc, self.owner_key)

    def _delete(self, desc: SegmentDescriptor) -> None:
        self._table.delete(desc.name, self.owner_key)

    def lookup(self, name: str) -> SegmentDescriptor | None:
        return self._table.get(name)

    def list(self) -> list[SegmentDescriptor]:
        return self._table.all()


class HttpDirectory(SegmentDirectory):
    """Client of the HTTP metadata service (``kvpool transfer metadata``); ``token``: the
    cluster token (None: from the environment), sent as the derived internal bearer."""

    def __init__(
        self, base_url: str, ttl: float = 10.0, token: str | None = None, timeout: float = 5.0
    ) -> None:
        super().__init__(ttl)
        self.base = base_url.rstrip("/")
        self.timeout = timeout
        token = auth.cluster_token(token)
        self._bearer = auth.internal_bearer(token) if token else None

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header(OWNER_KEY_HEADER, self.owner_key)
        if self._bearer:
            req.add_header("Authorization", f"Bearer {self._bearer}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read() or b"{}")
            except ValueError:
                return exc.code, {}
        except (OSError, ValueError) as exc:
            raise KVPoolError(f"metadata service {self.base} unreachable: {exc}") from exc

    def _path(self, name: str) -> str:
        return "/v1/segments/" + urllib.parse.quote(name, safe="")

    def _put(self, desc: SegmentDescriptor) -> None:
        code, body = self._request(
            "PUT", self._path(desc.name), {**desc.to_dict(), "ttl": self.ttl}
        )
        if code == 409:
            raise AlreadyExistsError(f"segment {desc.name!r} is already registered")
        if code >= 300:
            why = (body.get("error") or {}).get("message", "") if isinstance(body, dict) else ""
            raise KVPoolError(f"metadata service refused {desc.name!r}: HTTP {code} {why}")

    def _delete(self, desc: SegmentDescriptor) -> None:
        self._request("DELETE", self._path(desc.name))

    def _refresh(self) -> None:
        for desc in self._own_descriptors():
            self._put(desc)

    def lookup(self, name: str) -> SegmentDescriptor | None:
        code, body = self._request("GET", self._path(name))
        if code == 404:
            return None
        if code != 200:
            raise KVPoolError(f"metadata service lookup of {name!r} failed: HTTP {code}")
        return SegmentDescriptor.from_dict(body)

    def list(self) -> list[SegmentDescriptor]:
        _, body = self._request("GET", "/v1/segments")
        return [SegmentDescriptor.from_dict(d) for d in body.get("segments", [])]


class RpcDirectory(SegmentDirectory):
    """Client of a directory served over RPC (``rpc://HOST:PORT``: the store master's);
    ``token``: the cluster token (None: from the environment)."""

    def __init__(self, address: str, ttl: float = 10.0, token: str | None = None,
                 timeout: float = 5.0) -> None:  # fmt: skip
        from kvpool.common.rpc import RpcClient

        super().__init__(ttl)
        self.address = address
        self.rpc = RpcClient(address, token, timeout)

    def _put(self, desc: SegmentDescriptor) -> None:
        self.rpc.call("dir_put", desc.to_dict(), self.owner_key, self.ttl)

    def _delete(self, desc: SegmentDescriptor) -> None:
        self.rpc.call("dir_delete", desc.name, self.owner_key)

    def _refresh(self) -> None:
        for desc in self._own_descriptors():
            self._put(desc)

    def lookup(self, name: str) -> SegmentDescriptor | None:
        found = self.rpc.call("dir_get", name)
        return None if found is None else SegmentDescriptor.from_dict(found)

    def list(self) -> list[SegmentDescriptor]:
        return [SegmentDescriptor.from_dict(d) for d in self.rpc.call("dir_list")]

    def close(self) -> None:
        super().close()
        self.rpc.disconnect()  # lookups still work after close, as with the other backends


class EtcdDirectory(SegmentDirectory):
    """Descriptors in etcd under ``/kvpool/segments/``, bound to this owner's lease."""

    def __init__(self, endpoints: str, ttl: float = 10.0) -> None:
        super().__init__(ttl)
        self.etcd = EtcdClient(endpoints)
        self._lease = 0
        self._lease_lock = threading.Lock()

    def _lease_id(self) -> int:
        with self._lease_lock:
            if not self._lease:
                self._lease = self.etcd.lease_grant(self.ttl)
            return self._lease

    def _put(self, desc: SegmentDescriptor) -> None:
        key = ETCD_PREFIX + desc.name.encode()
        value = json.dumps(desc.to_dict()).encode()
        lease = self._lease_id()
        if self.etcd.create(key, value, lease):
            return
        raw = self.etcd.get(key)
        old = _parse(raw) if raw is not None else None
        if old is not None and old.owner_id != desc.owner_id:
            if not owner_is_dead(old):
                raise AlreadyExistsError(f"segment {desc.name!r} is already registered")
            logger.info("segment %s: owner %s is gone; taking over", desc.name, old.owner_id)
        self.etcd.put(key, value, lease)

    def _delete(self, desc: SegmentDescriptor) -> None:
        key = ETCD_PREFIX + desc.name.encode()
        raw = self.etcd.get(key)
        old = _parse(raw) if raw is not None else None
        if old is not None and old.owner_id == desc.owner_id:
            self.etcd.delete(key)

    def _refresh(self) -> None:
        with self._lease_lock:
            lease = self._lease
        if lease and self.etcd.lease_keepalive(lease) > 0:
            return
        with self._lease_lock:  # expired (etcd restarted, or we stalled): start over
            self._lease = 0
        for desc in self._own_descriptors():
            self._put(desc)

    def lookup(self, name: str) -> SegmentDescriptor | None:
        raw = self.etcd.get(ETCD_PREFIX + name.encode())
        return None if raw is None else _parse(raw, strict=True)

    def list(self) -> list[SegmentDescriptor]:
        return [d for _, v in self.etcd.get_prefix(ETCD_PREFIX) if (d := _parse(v)) is not None]

    def close(self) -> None:
        super().close()
        with self._lease_lock:
            lease, self._lease = self._lease, 0
        if lease:
            try:
                self.etcd.lease_revoke(lease)
            except EtcdError as exc:
                logger.debug("directory: lease revoke failed: %s", exc)


def _parse(raw: bytes, strict: bool = False) -> SegmentDescriptor | None:
    """A descriptor stored in etcd (anyone who reaches etcd can write there: validated);
    an invalid one is skipped, or with ``strict`` an error."""
    try:
        return SegmentDescriptor.from_dict(json.loads(raw))
    except (ValueError, BadRequestError) as exc:
        if strict:
            raise BadRequestError(f"invalid segment descriptor in etcd: {exc}") from None
        logger.warning("directory: skipping an invalid descriptor in etcd: %s", exc)
        return None


def directory_for(master: str) -> str:
    """The segment directory that goes with a store master: the master's own
    (``rpc://HOST:PORT``), or with ``etcd://...`` (masters that fail over) that etcd."""
    return master if master.startswith("etcd://") else f"rpc://{master}"


def open_directory(url: str, ttl: float = 10.0, token: str | None = None) -> SegmentDirectory:
    """The directory backend for ``memory``, ``rpc://HOST:PORT``, ``http://HOST:PORT`` or
    ``etcd://HOST:PORT,...``."""
    if url == "memory":
        return InProcessDirectory()
    if url.startswith("rpc://"):
        return RpcDirectory(url[len("rpc://") :], ttl=ttl, token=token)
    if url.startswith(("http://", "https://")):
        return HttpDirectory(url, ttl=ttl, token=token)
    if url.startswith("etcd://"):
        return EtcdDirectory(url[len("etcd://") :], ttl=ttl)
    raise BadRequestError(
        f"unknown segment directory {url!r} (memory, rpc://..., http://..., etcd://...)"
    )


def wait_for(directory: SegmentDirectory, name: str, timeout: float = 10.0) -> SegmentDescriptor:
    """Poll until ``name`` is published (for peers that start in any order)."""
    deadline = time.monotonic() + timeout
    while True:
        desc = directory.lookup(name)
        if desc is not None:
            return desc
        if time.monotonic() > deadline:
            raise KVPoolError(f"segment {name!r} not published within {timeout} s")
        time.sleep(0.05)
