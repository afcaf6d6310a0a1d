"""The segment directory: where engines publish segment descriptors and find each other's.

One interface, three backends, chosen by URL (``TransferConfig.directory``):

- ``memory``: a dictionary shared by every engine of this process (single-process use, tests);
- ``http://HOST:PORT``: the small metadata service of ``metadata_server.py``;
- ``etcd://HOST:PORT[,HOST:PORT]``: etcd, for several hosts; descriptors live under
  ``/kvpool/segments/<name>`` attached to the owner's lease, so a dead owner's segments vanish
  when its lease expires.

Owners keep their entries alive (the HTTP service and etcd drop entries not renewed within
``ttl``); a name held by another live owner is refused with ``AlreadyExistsError``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod

from kvpool.common.errors import AlreadyExistsError, BadRequestError, KVPoolError
from kvpool.common.etcd import EtcdClient, EtcdError
from kvpool.transfer.segment import SegmentDescriptor

logger = logging.getLogger(__name__)

ETCD_PREFIX = b"/kvpool/segments/"


class SegmentDirectory(ABC):
    """Publishes this process's descriptors and looks up anyone's."""

    def __init__(self, ttl: float = 10.0) -> None:
        self.ttl = ttl
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

    def evict(self, desc: SegmentDescriptor) -> None:
        """Remove another owner's entry (only if ``desc``'s owner still holds the name)."""
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


class DescriptorTable:
    """Descriptors by name, one owner per name (the in-process store and the HTTP service's)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[SegmentDescriptor, float]] = {}
        self._lock = threading.Lock()

    def put(self, desc: SegmentDescriptor, ttl: float | None = None) -> None:
        """Insert or renew; ``AlreadyExistsError`` if another live owner holds the name."""
        with self._lock:
            old = self._live(desc.name)
            if old is not None and old.owner_id != desc.owner_id:
                raise AlreadyExistsError(f"segment {desc.name!r} is already registered")
            expires = float("inf") if ttl is None else time.monotonic() + ttl
            self._entries[desc.name] = (desc, expires)

    def delete(self, name: str, owner_id: str) -> bool:
        with self._lock:
            old = self._live(name)
            if old is None or old.owner_id != owner_id:
                return False
            del self._entries[name]
            return True

    def get(self, name: str) -> SegmentDescriptor | None:
        with self._lock:
            return self._live(name)

    def all(self) -> list[SegmentDescriptor]:
        with self._lock:
            return [d for d in (self._live(n) for n in list(self._entries)) if d is not None]

    def _live(self, name: str) -> SegmentDescriptor | None:
        entry = self._entries.get(name)
        if entry is None:
            return None
        if entry[1] < time.monotonic():
            del self._entries[name]
            return None
        return entry[0]


_PROCESS_TABLE = DescriptorTable()


class InProcessDirectory(SegmentDirectory):
    """A table shared by every engine of this process (closing withdraws only its own)."""

    def __init__(self, table: DescriptorTable | None = None) -> None:
        super().__init__()
        self._table = table if table is not None else _PROCESS_TABLE

    def _put(self, desc: SegmentDescriptor) -> None:
        self._table.put(desc)

    def _delete(self, desc: SegmentDescriptor) -> None:
        self._table.delete(desc.name, desc.owner_id)

    def lookup(self, name: str) -> SegmentDescriptor | None:
        return self._table.get(name)

    def list(self) -> list[SegmentDescriptor]:
        return self._table.all()


class HttpDirectory(SegmentDirectory):
    """Client of the HTTP metadata service (``kvpool transfer metadata``)."""

    def __init__(
        self, base_url: str, ttl: float = 10.0, token: str | None = None, timeout: float = 5.0
    ) -> None:
        super().__init__(ttl)
        self.base = base_url.rstrip("/")
        self.timeout = timeout
        self.token = token

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
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
            raise KVPoolError(f"metadata service refused {desc.name!r}: HTTP {code} {body}")

    def _delete(self, desc: SegmentDescriptor) -> None:
        owner = urllib.parse.quote(desc.owner_id)
        self._request("DELETE", f"{self._path(desc.name)}?owner={owner}")

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
        old = self.etcd.get(key)
        if old is not None and json.loads(old).get("owner_id") != desc.owner_id:
            raise AlreadyExistsError(f"segment {desc.name!r} is already registered")
        self.etcd.put(key, value, lease)

    def _delete(self, desc: SegmentDescriptor) -> None:
        key = ETCD_PREFIX + desc.name.encode()
        old = self.etcd.get(key)
        if old is not None and json.loads(old).get("owner_id") == desc.owner_id:
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
        return None if raw is None else SegmentDescriptor.from_dict(json.loads(raw))

    def list(self) -> list[SegmentDescriptor]:
        return [
            SegmentDescriptor.from_dict(json.loads(v)) for _, v in self.etcd.get_prefix(ETCD_PREFIX)
        ]

    def close(self) -> None:
        super().close()
        with self._lease_lock:
            lease, self._lease = self._lease, 0
        if lease:
            try:
                self.etcd.lease_revoke(lease)
            except EtcdError as exc:
                logger.debug("directory: lease revoke failed: %s", exc)


def open_directory(url: str, ttl: float = 10.0, token: str | None = None) -> SegmentDirectory:
    """The directory backend for ``memory``, ``http://HOST:PORT`` or ``etcd://HOST:PORT,...``."""
    if url == "memory":
        return InProcessDirectory()
    if url.startswith(("http://", "https://")):
        return HttpDirectory(url, ttl=ttl, token=token)
    if url.startswith("etcd://"):
        return EtcdDirectory(url[len("etcd://") :], ttl=ttl)
    raise BadRequestError(f"unknown segment directory {url!r} (memory, http://..., etcd://...)")


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
