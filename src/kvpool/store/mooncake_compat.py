"""``MooncakeDistributedStore``: Mooncake Store's Python API over kvpool.

Code written for ``mooncake.store.MooncakeDistributedStore`` runs unchanged: same method names,
argument order and returns (0 or a negative Mooncake ``ErrorCode``; ``b""`` for a missing key).
``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
rdma_devices, master_server_addr)``: ``master_server_addr`` is a ``kvpool store master``;
``metadata_server`` is the segment directory (``http://H:P[/metadata]`` -> ``http://H:P``,
``etcd://...``, bare ``H:P[,H:P]`` -> ``etcd://``, ``P2PHANDSHAKE`` -> the master's own
directory, which every process that reaches the master reaches too); ``global_segment_size`` > 0
runs a ``StorageNode`` of that many bytes, 0 is a pure client; ``protocol`` ``"tcp"`` forces TCP,
anything else (``"rdma"``) means shm on this host, TCP elsewhere (kvpool has no RDMA);
``rdma_devices`` and ``local_buffer_size`` are ignored (no staging buffer). A non-loopback
``local_hostname`` is the transfer server's bind address and needs ``KVPOOL_AUTH_TOKEN``.

Codes: -1 INTERNAL_ERROR, -10 BUFFER_OVERFLOW, -200 NO_AVAILABLE_HANDLE (no space), -600
INVALID_PARAMS (also a pointer outside registered memory), -704 OBJECT_NOT_FOUND, -706
OBJECT_HAS_LEASE, -800 TRANSFER_FAIL, -900 RPC_FAIL, -1010 UNAVAILABLE_IN_CURRENT_STATUS (not
set up, or set up twice). Putting an existing key returns 0 and keeps the first value.

Not implemented (``NotImplementedError``, and ``hasattr`` is False): ``upsert*``, ``get_buffer``,
``batch_get_buffer``, ``remove_all``, ``remove_by_regex``, ``*tensor*``, ``*_multi_buffers``,
``get_into_ranges``, ``put_from_with_metadata``, replica descriptors, copy/move tasks, segment
mounting, ``setup_dummy``, ``init_all``, ``alloc_from_mem_pool``. Of ``ReplicateConfig`` only
``replica_num`` is used.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import re
import threading
from typing import Any

import numpy as np

from kvpool.common import errors
from kvpool.common.errors import BadRequestError, KVPoolError
from kvpool.common.net import is_loopback
from kvpool.config import TransferConfig
from kvpool.store.client import StoreClient
from kvpool.store.client import transfer_config as with_master
from kvpool.store.node import StorageNode
from kvpool.transfer import TransferEngine
from kvpool.transfer.segment import byte_view

logger = logging.getLogger(__name__)

OK, INTERNAL_ERROR, BUFFER_OVERFLOW, NO_AVAILABLE_HANDLE, INVALID_PARAMS = 0, -1, -10, -200, -600
REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, OBJECT_HAS_LEASE = (
    -703,
    -704,
    -705,
    -706,
)
TRANSFER_FAIL, RPC_FAIL, UNAVAILABLE_IN_CURRENT_STATUS = -800, -900, -1010

_CODES: list[tuple[type[BaseException], int]] = [
    (errors.NotFoundError, OBJECT_NOT_FOUND),
    (errors.PutInProgressError, REPLICA_IS_NOT_READY),  # another put of it has not ended
    (errors.AlreadyExistsError, OBJECT_ALREADY_EXISTS),
    (errors.LeaseExpiredError, OBJECT_HAS_LEASE),  # kvpool's "remove refused: leased"
    (errors.NoSpaceError, NO_AVAILABLE_HANDLE),
    ((errors.TransferError, errors.BackpressureError), TRANSFER_FAIL),
    ((errors.KVPoolTimeoutError, errors.ProtocolError, errors.ConnectionLostError), RPC_FAIL),
    ((ValueError, TypeError), INVALID_PARAMS),  # BadRequestError, bad config values
]
_UNSUPPORTED = {  # and every "*tensor*" name
    *("upsert", "upsert_from", "batch_upsert_from", "upsert_parts", "upsert_batch"),
    *("get_buffer", "batch_get_buffer", "remove_all", "remove_by_regex", "get_into_ranges"),
    *("batch_put_from_multi_buffers", "batch_get_into_multi_buffers", "put_from_with_metadata"),
    *("get_replica_desc", "batch_get_replica_desc", "create_copy_task", "create_move_task"),
    *("query_task", "mount_segment", "unmount_segment", "allocate_and_mount_segment"),
    *("unmount_and_free_segment", "setup_dummy", "init_all", "alloc_from_mem_pool"),
}
_instances = itertools.count()


class MooncakeUnsupportedError(NotImplementedError, AttributeError):
    """A Mooncake API the adapter does not provide (an AttributeError too, so probing works)."""


class _StateError(KVPoolError):
    """Called before ``setup``, or ``setup`` on a live store."""


def error_code(exc: BaseException) -> int:
    """The Mooncake ``ErrorCode`` value for a kvpool exception."""
    if isinstance(exc, _StateError):
        return UNAVAILABLE_IN_CURRENT_STATUS
    return next((code for cls, code in _CODES if isinstance(exc, cls)), INTERNAL_ERROR)


def _logged(op: str, exc: Exception) -> int:
    code = error_code(exc)
    expected = code in (OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)
    logger.log(logging.DEBUG if expected else logging.WARNING, "mooncake %s: %d %s", op, code, exc)
    return code


def _returns_code(method):
    """Turn any exception of ``method`` into a logged negative error code."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            return _logged(method.__name__, exc)

    return wrapper


def _put_code(result: object) -> int:
    """A batch_put result (None or an exception) as a code; an existing key counts as done."""
    if result is None or isinstance(result, errors.AlreadyExistsError):
        return OK
    return result if isinstance(result, int) else error_code(result)  # type: ignore[arg-type]


def directory_url(metadata_server: str) -> str | None:
    """kvpool's segment directory URL for a Mooncake ``metadata_server`` value (None: the
    master's own, for ``P2PHANDSHAKE``: peers find each other through the master)."""
    url = metadata_server.strip()
    if url.upper() == "P2PHANDSHAKE":
        return None
    if url == "memory":
        return "memory"
    if url.startswith(("http://", "https://")):
        return url.rstrip("/").removesuffix("/metadata")
    if url.startswith("etcd://"):
        return url
    if re.fullmatch(r"[\w.\-]+:\d+(,[\w.\-]+:\d+)*", url):  # Mooncake's bare etcd endpoints
        return "etcd://" + url
    raise BadRequestError(f"unsupported metadata_server {metadata_server!r}")


def transfer_config(local_hostname: str, metadata_server: str, protocol: str,
                    master: str | None = None) -> TransferConfig:  # fmt: skip
    """The transfer engine's config for Mooncake's ``setup`` arguments."""
    if protocol.lower() != "tcp":
        logger.info("mooncake: protocol %r: no RDMA in kvpool, using shm/TCP", protocol)
    if local_hostname.startswith("["):  # [v6]:port
        host = local_hostname[1 : local_hostname.find("]")]
    else:
        host = local_hostname.split(":")[0] if local_hostname.count(":") == 1 else local_hostname
    config = TransferConfig(
        host="127.0.0.1" if not host or is_loopback(host) else host,
        directory=directory_url(metadata_server),
        transport="tcp" if protocol.lower() == "tcp" else "auto",
    )
    return with_master(config, None, master)


def _address(buf) -> int:
    if isinstance(buf, int):
        return buf
    return np.frombuffer(byte_view(buf, writable=False), dtype=np.uint8).ctypes.data


class RegisteredMemory:
    """Buffers registered by address; the only memory zero-copy calls read or write."""

    def __init__(self) -> None:
        self._regions: dict[int, tuple[np.ndarray, bool]] = {}  # start -> (uint8 view, writable)
        self._lock = threading.Lock()

    def add(self, buf, size: int | None) -> None:
        """``buf``: a raw address (``tensor.data_ptr()``, ``arr.ctypes.data``) of ``size`` bytes,
        or a buffer object (kept alive while registered)."""
        if isinstance(buf, int):
            if buf <= 0 or not size or size <= 0:
                raise BadRequestError("need a non-null pointer and size > 0")
            arr = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(buf))
            start, writable = buf, True
        else:
            view = byte_view(buf, writable=False)
            arr = np.frombuffer(view, dtype=np.uint8)[:size]
            start, writable = arr.ctypes.data, not view.readonly
            if arr.size == 0 or (size or 0) > len(view):
                raise BadRequestError(f"cannot register {size} bytes of a {len(view)}-byte buffer")
        with self._lock:
            old = self._regions.get(start)
            if old is not None and old[0].size == arr.size:
                return  # the same range again
            for s, (a, _) in self._regions.items():
                if s < start + arr.size and start < s + a.size:
                    raise BadRequestError(f"{start:#x}+{arr.size} overlaps a registered buffer")
            self._regions[start] = (arr, writable)

    def remove(self, buf) -> None:
        with self._lock:
            if self._regions.pop(_address(buf), None) is None:
                raise BadRequestError("buffer is not registered")

    def view(self, ptr, size: int, writable: bool) -> np.ndarray:
        """``[ptr, ptr + size)`` if it lies inside one registered buffer; else BadRequestError."""
        start = _address(ptr)
        with self._lock:
            for s, (arr, can_write) in self._regions.items():
                if s <= start and size > 0 and start + size <= s + arr.size:
                    if writable and not can_write:
                        raise BadRequestError("registered buffer is read-only")
                    return arr[start - s : start - s + size]
        raise BadRequestError(f"{start:#x}+{size} is not inside a registered buffer")

    def views(self, ptrs: list, sizes: list[int], writable: bool) -> tuple[list, list[int], list]:
        """(codes with INVALID_PARAMS everywhere, indexes of the valid items, their views)."""
        codes, idx, views = [INVALID_PARAMS] * len(ptrs), [], []
        for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
            try:
                views.append(self.view(ptr, size, writable))
                idx.append(i)
            except BadRequestError as exc:
                logger.warning("mooncake: item %d: %s", i, exc)
        return codes, idx, views

    def clear(self) -> None:
        with self._lock:
            self._regions.clear()


class MooncakeDistributedStore:
    """Mooncake Store's Python class over kvpool (a node of the pool and/or a client)."""

    setup_timeout = 3.0  # seconds to wait for the master during setup

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._node: StorageNode | None = None
        self._engine: TransferEngine | None = None
        self._hostname = ""
        self.buffers = RegisteredMemory()

    @_returns_code
    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int = 16 << 20,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
    ) -> int:
        """Connect to the master (and mount ``global_segment_size`` bytes); 0 on success."""
        master = master_server_addr
        if self._client is not None:
            raise _StateError("already set up: close() first")
        config = transfer_config(local_hostname, metadata_server, protocol, master)
        engine = TransferEngine(config)
        client: StoreClient | None = None
        try:
            if config.directory != "memory":
                engine.directory.lookup("mooncake-compat-probe")  # raises when unreachable
            client = StoreClient(master, engine)
            client.master.call("stats", timeout=self.setup_timeout)
            if global_segment_size > 0:
                name = re.sub(r"[^\w.\-]", "_", local_hostname)
                node_id = f"mooncake-{name}-{os.getpid()}-{next(_instances)}"
                self._node = StorageNode(node_id, master, int(global_segment_size), engine)
        except BaseException:
            if client is not None:
                client.close()
            engine.close()
            raise
        self._engine, self._client, self._hostname = engine, client, local_hostname
        return OK

    def close(self) -> int:
        """Release everything (idempotent); 0."""
        parts = (self._client, self._node, self._engine)
        self._client = self._node = self._engine = None
        for part in parts:
            try:
                if part is not None:
                    part.close()
            except Exception as exc:  # closing must not fail the caller
                logger.warning("mooncake: closing %s: %s", type(part).__name__, exc)
        self.buffers.clear()
        return OK

    def get_hostname(self) -> str:
        return self._hostname

    def __getattr__(self, name: str):
        if name in _UNSUPPORTED or "tensor" in name:
            raise MooncakeUnsupportedError(f"MooncakeDistributedStore.{name} is not supported")
        raise AttributeError(name)

    def _call(self, op: str, fn):
        """``fn(client)``, or the error code."""
        try:
            if self._client is None:
                raise _StateError("not set up: call setup() first")
            return fn(self._client)
        except Exception as exc:
            return _logged(op, exc)

    # -- values ---------------------------------------------------------------------------------

    def put(self, key: str, value, config: Any = None) -> int:
        return self.put_batch([key], [value], config)

    def put_parts(self, key: str, *parts, config: Any = None) -> int:
        return self.put(key, b"".join(bytes(byte_view(p, writable=False)) for p in parts), config)

    def put_batch(self, keys: list[str], values: list, config: Any = None) -> int:
        """0, or the first error; an existing key is success and keeps its first value."""
        results = self._call(
            "put", lambda c: c.batch_put(list(keys), list(values), _replicas(config))
        )
        codes = [_put_code(r) for r in results] if isinstance(results, list) else [results]
        return next((c for c in codes if c != OK), OK)

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when missing (or unreadable)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        values = self._call("get", lambda c: c.batch_get(list(keys)))
        return [v or b"" for v in values] if isinstance(values, list) else [b""] * len(keys)

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        found = self._call("is_exist", lambda c: c.batch_exists(list(keys)))
        return [int(f) for f in found] if isinstance(found, list) else [-1] * len(keys)

    def get_size(self, key: str) -> int:
        return self._call("get_size", lambda c: c.get_size(key))

    def remove(self, key: str, force: bool = False) -> int:
        return self._call("remove", lambda c: c.remove(key, force)) or OK

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return [self.remove(k, force) for k in keys]

    # -- registered memory (zero copy) ----------------------------------------------------------

    @_returns_code
    def register_buffer(self, buffer_ptr, size: int | None = None) -> int:
        self.buffers.add(buffer_ptr, size)
        return OK

    @_returns_code
    def unregister_buffer(self, buffer_ptr) -> int:
        self.buffers.remove(buffer_ptr)
        return OK

    def put_from(self, key: str, buffer_ptr, size: int, config: Any = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def get_into(self, key: str, buffer_ptr, size: int) -> int:
        """Bytes read into registered memory, or a negative code."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list, sizes: list[int], config: Any = None
    ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        codes, idx, views = self.buffers.views(buffer_ptrs, sizes, writable=False)
        if idx:
            todo = [keys[i] for i in idx]
            res = self._call("put_from", lambda c: c.batch_put(todo, views, _replicas(config)))
            for i, r in zip(idx, res if isinstance(res, list) else [res] * len(idx), strict=True):
                codes[i] = _put_code(r)
        return codes

    def batch_get_into(self, keys: list[str], buffer_ptrs: list, sizes: list[int]) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        codes, idx, views = self.buffers.views(buffer_ptrs, sizes, writable=True)
        if idx:
            got = self._call("get_into", lambda c: c.batch_get_into([keys[i] for i in idx], views))
            for i, n in zip(idx, got if isinstance(got, list) else [got] * len(idx), strict=True):
                codes[i] = n if n >= 0 else self._why_not_read(keys[i], sizes[i])
        return codes

    def _why_not_read(self, key: str, size: int) -> int:
        """Classify a failed read: missing, buffer too small, or a transfer failure."""
        have = self.get_size(key)
        return have if have < 0 else BUFFER_OVERFLOW if have > size else TRANSFER_FAIL


def _replicas(config: Any) -> int | None:
    return getattr(config, "replica_num", None) if config is not None else None
