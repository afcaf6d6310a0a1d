"""``MooncakeDistributedStore``: Mooncake Store's Python class over kvpool (a node of the pool
and/or a client), with ``setup`` from arguments or a config dict, ``close``, ``health_check``
and ``get_hostname``; the calls are in ``values.py``, ``zerocopy.py`` and ``tensor_api.py``."""

from __future__ import annotations

import logging
import re
from typing import Any

from kvpool.common import auth
from kvpool.common.errors import BadRequestError, KVPoolError
from kvpool.common.net import is_loopback
from kvpool.config import TransferConfig
from kvpool.integrations.mooncake.codes import OK, StateError, logged
from kvpool.integrations.mooncake.memory import RegisteredMemory
from kvpool.integrations.mooncake.tensor_api import Tensors
from kvpool.integrations.mooncake.types import ReplicateConfig, mooncake_size
from kvpool.integrations.mooncake.values import Values
from kvpool.integrations.mooncake.zerocopy import ZeroCopy
from kvpool.protocol.store import PutOptions
from kvpool.store.client import StoreClient
from kvpool.store.client import transfer_config as with_master
from kvpool.store.node import StorageNode
from kvpool.transfer import TransferEngine

logger = logging.getLogger("kvpool.integrations.mooncake")

# Mooncake calls that need RDMA, a GPU, its task or session machinery, or tensor-parallel
# layouts: they raise MooncakeUnsupportedError (an AttributeError too, so probing works)
UNSUPPORTED = frozenset({
    "put_from_with_metadata", "batch_put_from_multi_buffer_ranges",
    "batch_get_into_multi_buffer_ranges", "batch_replica_clear", "create_copy_task",
    "create_move_task", "query_task", "mount_segment", "unmount_segment",
    "allocate_and_mount_segment", "unmount_and_free_segment", "unmount_local_disk_segment",
    "setup_dummy", "init_all", "alloc_from_mem_pool", "get_offload_rpc_read_count",
    "batch_get_session_start", "batch_get_session_end", "batch_put_session_start",
    "batch_put_session_end", "batch_put_session_revoke", "save_tensor_to_safetensor",
    "load_tensor_from_safetensor",
})  # fmt: skip
_UNSUPPORTED_PARTS = ("_with_tp", "_with_parallelism", "pub_tensor", "_cuda")
_CONFIG_KEYS = {"local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
                "protocol", "rdma_devices", "master_server_addr", "ipc_socket_path",
                "enable_ssd_offload", "ssd_offload_path", "tenant_id",
                "enable_client_http_server", "client_http_port"}  # fmt: skip


class MooncakeUnsupportedError(NotImplementedError, AttributeError):
    """A Mooncake API the adapter does not provide (an AttributeError too, so probing works)."""


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


def _host_of(local_hostname: str) -> str:
    """The host part of Mooncake's ``local_hostname`` (``host``, ``host:port``, ``[v6]:port``)."""
    if local_hostname.startswith("["):
        return local_hostname[1 : local_hostname.find("]")]
    return local_hostname.split(":")[0] if local_hostname.count(":") == 1 else local_hostname


def transfer_config(local_hostname: str, metadata_server: str, protocol: str,
                    master: str | None = None) -> TransferConfig:  # fmt: skip
    """The transfer engine's config for Mooncake's ``setup`` arguments."""
    if protocol.lower() != "tcp":
        logger.info("mooncake: protocol %r: no RDMA in kvpool, using shm/TCP", protocol)
    host = _host_of(local_hostname)
    config = TransferConfig(
        host="127.0.0.1" if not host or is_loopback(host) else host,
        directory=directory_url(metadata_server),
        transport="tcp" if protocol.lower() == "tcp" else "auto",
    )
    return with_master(config, None, master)


class MooncakeDistributedStore(Values, ZeroCopy, Tensors):
    """Mooncake Store's Python class over kvpool (see ``kvpool.integrations.mooncake``)."""

    setup_timeout = 3.0  # seconds to wait for the master during setup

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._node: StorageNode | None = None
        self._engine: TransferEngine | None = None
        self._hostname = ""
        self.buffers = RegisteredMemory()

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size=16 MiB,
        local_buffer_size=16 MiB, protocol="tcp", rdma_devices="",
        master_server_addr="127.0.0.1:50051", ...)`` or ``setup(config_dict)`` with those
        keys (sizes as numbers or Mooncake strings such as ``"16 MB"``); 0 on success."""
        try:
            if len(args) == 1 and not kwargs and isinstance(args[0], dict):
                kwargs = _from_config(args[0])
                args = ()
            return self._setup(*args, **kwargs)
        except Exception as exc:
            return logged("setup", exc)

    def _setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int | str = 16 << 20,
        local_buffer_size: int | str = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        *extra: Any,
        **ignored: Any,
    ) -> int:
        master, segment = master_server_addr, mooncake_size(global_segment_size)
        mooncake_size(local_buffer_size)  # validated; kvpool needs no staging buffer
        if self._client is not None:
            raise StateError("already set up: close() first")
        config = transfer_config(local_hostname, metadata_server, protocol, master)
        engine = TransferEngine(config)
        client: StoreClient | None = None
        try:
            if config.directory not in ("memory", None):
                engine.directory.lookup("mooncake-compat-probe")  # raises when unreachable
            client = StoreClient(master, engine, admin_token=auth.admin_token())
            client.master.call("stats", timeout=self.setup_timeout)
            hostname = f"{_host_of(local_hostname) or engine.host}:{engine.port}"
            if segment > 0:  # named as Mooncake names segments: preferred_segment finds it
                self._node = StorageNode(hostname, master, segment, engine)
        except BaseException:
            if client is not None:
                client.close()
            engine.close()
            raise
        self._engine, self._client, self._hostname = engine, client, hostname
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
        """``host:port`` of this store's transfer server (its segment's name, if it has one)."""
        return self._hostname

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 master unreachable."""
        if self._client is None:
            return 1
        try:
            self._client.master.call("stats", timeout=2.0)
        except KVPoolError:
            return 2
        return 0

    def __getattr__(self, name: str):
        if name in UNSUPPORTED or any(p in name for p in _UNSUPPORTED_PARTS):
            raise MooncakeUnsupportedError(f"MooncakeDistributedStore.{name} is not supported")
        raise AttributeError(name)

    # -- for the mixins -------------------------------------------------------------------------

    def _call(self, op: str, fn):
        """``fn(client)``, or the error code."""
        try:
            if self._client is None:
                raise StateError("not set up: call setup() first")
            return fn(self._client)
        except Exception as exc:
            return logged(op, exc)

    def _options(self, config: Any, upsert: bool) -> PutOptions | None:
        if config is None:
            return PutOptions(upsert=True) if upsert else None
        own = self._hostname if self._node is not None else None
        if isinstance(config, ReplicateConfig):
            return config.options(upsert, own)
        return PutOptions(upsert=upsert)  # a foreign config object: its replica_num only

    @staticmethod
    def _replicas(config: Any) -> int | None:
        return getattr(config, "replica_num", None) if config is not None else None


def _from_config(config: dict) -> dict:
    """``setup``'s arguments from Mooncake's config dict."""
    unknown = set(config) - _CONFIG_KEYS
    if unknown:
        logger.info("mooncake setup: ignoring %s", sorted(unknown))
    for key in ("local_hostname", "metadata_server"):
        if not isinstance(config.get(key), str) or not config[key]:
            raise BadRequestError(f"setup config needs {key!r}")
    out = {k: config[k] for k in ("local_hostname", "metadata_server", "protocol",
                                  "rdma_devices", "master_server_addr") if k in config}  # fmt: skip
    for key in ("global_segment_size", "local_buffer_size"):
        if key in config:
            out[key] = mooncake_size(config[key])
    return out
