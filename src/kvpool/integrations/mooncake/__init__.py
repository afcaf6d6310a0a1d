"""Mooncake Store's Python API over kvpool's pool: code written for ``mooncake.store`` runs
with its import changed to ``from kvpool.integrations.mooncake import ...``.

``MooncakeDistributedStore`` keeps Mooncake's method names, argument order and returns (0 or a
negative Mooncake ``ErrorCode``; ``b""`` or None for a missing key). ``setup(local_hostname,
metadata_server, global_segment_size, local_buffer_size, protocol, rdma_devices,
master_server_addr)`` or ``setup(config_dict)`` (sizes like ``"16 MB"`` are binary, as
Mooncake's): ``master_server_addr`` is a ``kvpool store master``; ``metadata_server`` is the
segment directory (``P2PHANDSHAKE``: the master's own, across processes and hosts;
``http://H:P[/metadata]``; ``etcd://...`` or bare ``H:P[,H:P]``); ``global_segment_size`` > 0
runs a storage node of that many bytes, named ``get_hostname()`` (``host:port``, what
``preferred_segment`` names), 0 is a pure client; ``protocol`` ``"tcp"`` forces TCP, anything
else means shared memory on this host and TCP elsewhere (kvpool has no RDMA).

Provided: put / get / put_batch / get_batch / put_parts, upsert / upsert_batch / upsert_parts /
upsert_from / batch_upsert_from, get_buffer / batch_get_buffer (``BufferHandle``),
is_exist / batch_is_exist / get_size, remove / batch_remove / remove_all / remove_by_regex,
register_buffer / unregister_buffer, put_from / get_into / batch_put_from / batch_get_into,
batch_put_from_multi_buffers / batch_get_into_multi_buffers, get_into_ranges,
put_tensor / get_tensor / batch_put_tensor / batch_get_tensor / upsert_tensor /
batch_upsert_tensor / get_tensor_into / batch_get_tensor_into / put_tensor_from /
batch_put_tensor_from (CPU tensors, in Mooncake's value layout), get_replica_desc /
batch_get_replica_desc, health_check, get_hostname, close. ``ReplicateConfig``: replica_num,
soft pins (``soft_pin_action`` / ``with_soft_pin``, ``soft_pin_ttl_ms``), ``with_hard_pin``,
``preferred_segment(s)``, ``prefer_alloc_in_same_node``.

Differences, on purpose: a pointer or range outside registered memory is refused
(INVALID_PARAMS) where Mooncake's TCP path reads or writes it; calls after ``close()`` answer
UNAVAILABLE_IN_CURRENT_STATUS (-1010) where Mooncake crashes; a put of a key another put has
not ended answers REPLICA_IS_NOT_READY (-703), never 0; byte ranges are not checksummed (whole
values are); a 0-dimensional tensor comes back with shape ``()`` (Mooncake's: ``(1,)``); a
0-byte ``put_from`` is INVALID_PARAMS (Mooncake answers 0 and stores nothing);
``ReplicateConfig.with_soft_pin`` (an earlier Mooncake spelling) is accepted, and
``prefer_alloc_in_same_node`` works (Mooncake 0.3.13 refuses every put with it). The
differential suite (``tests/integration/mooncake/test_mooncake_diff.py``) checks all of this call by
call against the real wheel; a lookup leases the object, as there.
Not provided (``MooncakeUnsupportedError``, and ``hasattr`` is False): tensor-parallel and CUDA forms, ``pub_tensor*``, copy/move tasks,
sessions, segment mounting, safetensors files, ``put_from_with_metadata``, the
multi-buffer-range forms, ``batch_replica_clear``, ``setup_dummy``, ``init_all``,
``alloc_from_mem_pool``. Error codes: -1 INTERNAL_ERROR, -200 NO_AVAILABLE_HANDLE (no space),
-600 INVALID_PARAMS, -703 REPLICA_IS_NOT_READY, -704 OBJECT_NOT_FOUND, -706 OBJECT_HAS_LEASE,
-800 TRANSFER_FAIL, -900 RPC_FAIL, -1010 UNAVAILABLE_IN_CURRENT_STATUS.
"""

from kvpool.integrations.mooncake.codes import (
    BUFFER_OVERFLOW,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    OK,
    REPLICA_IS_NOT_READY,
    RPC_FAIL,
    TRANSFER_FAIL,
    UNAVAILABLE_IN_CURRENT_STATUS,
    error_code,
)
from kvpool.integrations.mooncake.memory import RegisteredMemory
from kvpool.integrations.mooncake.store import (
    UNSUPPORTED,
    MooncakeDistributedStore,
    MooncakeUnsupportedError,
    directory_url,
    transfer_config,
)
from kvpool.integrations.mooncake.types import (
    BufferHandle,
    Descriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    mooncake_size,
)

__all__ = [
    "BUFFER_OVERFLOW", "INTERNAL_ERROR", "INVALID_PARAMS", "NO_AVAILABLE_HANDLE",
    "OBJECT_ALREADY_EXISTS", "OBJECT_HAS_LEASE", "OBJECT_NOT_FOUND", "OK",
    "REPLICA_IS_NOT_READY", "RPC_FAIL", "TRANSFER_FAIL", "UNAVAILABLE_IN_CURRENT_STATUS",
    "UNSUPPORTED", "BufferHandle", "Descriptor", "MemoryDescriptor", "MooncakeDistributedStore",
    "MooncakeUnsupportedError", "RegisteredMemory", "ReplicaDescriptor", "ReplicaStatus",
    "ReplicateConfig", "SoftPinAction", "directory_url", "error_code", "mooncake_size",
    "transfer_config",
]  # fmt: skip
