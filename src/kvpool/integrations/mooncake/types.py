"""Mooncake Store's Python value classes: ``ReplicateConfig``, ``SoftPinAction``,
``ReplicaStatus``, replica descriptors and ``BufferHandle``; and its configuration sizes."""

from __future__ import annotations

import ctypes
import enum
import re
from dataclasses import dataclass, field

from kvpool.protocol.store import ObjectDesc, PutOptions


class SoftPinAction(enum.Enum):
    PRESERVE = 0  # keep what the object had (a new object: not pinned)
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(enum.Enum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ReplicateConfig:
    """Mooncake's replication and placement settings of a put (the fields and defaults of
    ``mooncake.store.ReplicateConfig``; ``with_soft_pin`` is the older spelling of
    ``soft_pin_action = SoftPinAction.ENABLE``). kvpool uses ``replica_num``, the pins, the
    preferred segments and ``prefer_alloc_in_same_node``; the rest is kept, and ignored."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.nof_replica_num = 0
        self.preferred_nof_segments: list[str] = []
        self.dfs_replica_num = 0
        self.data_type = 0
        self.group_ids: list[int] = []

    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin_action is SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin_action = SoftPinAction.ENABLE if value else SoftPinAction.PRESERVE

    def options(self, upsert: bool = False, own_segment: str | None = None) -> PutOptions:
        """kvpool's ``PutOptions`` for a put with this config (``own_segment``: this store's,
        preferred with ``prefer_alloc_in_same_node``)."""
        if not isinstance(self.replica_num, int) or self.replica_num < 1:
            raise ValueError("replica_num must be a positive integer")
        preferred = [s for s in (self.preferred_segment, *self.preferred_segments) if s]
        if self.prefer_alloc_in_same_node and own_segment:
            preferred.insert(0, own_segment)
        ttl = self.soft_pin_ttl_ms
        return PutOptions(upsert=upsert, preferred=tuple(preferred[:64]),
                          soft_pin=self.soft_pin_action is SoftPinAction.ENABLE,
                          pin_ttl=ttl / 1000 if ttl else None, hard_pin=bool(self.with_hard_pin))  # fmt: skip

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, soft_pin_action="
                f"{self.soft_pin_action.name}, with_hard_pin={self.with_hard_pin}, "
                f"preferred_segment={self.preferred_segment!r})")  # fmt: skip


@dataclass
class Descriptor:
    """Where a memory replica's bytes are (Mooncake's ``AllocatedBuffer::Descriptor``)."""

    size: int = 0
    buffer_address: int = 0  # the offset inside its node's segment (kvpool has no raw address)
    transport_endpoint: str = ""  # the node holding it


@dataclass
class MemoryDescriptor:
    buffer_descriptor: Descriptor = field(default_factory=Descriptor)


@dataclass
class ReplicaDescriptor:
    """One replica of an object (``get_replica_desc``)."""

    status: ReplicaStatus = ReplicaStatus.COMPLETE
    memory: MemoryDescriptor | None = None
    tier: str = "dram"

    def is_memory_replica(self) -> bool:
        return self.tier == "dram"

    def is_disk_replica(self) -> bool:
        return self.tier == "ssd"

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self.memory is None:
            raise RuntimeError("not a memory replica")
        return self.memory

    def get_disk_descriptor(self):
        raise RuntimeError("kvpool's SSD tier is memory-mapped: no disk descriptor")


def replica_descriptors(meta: ObjectDesc | None) -> list[ReplicaDescriptor]:
    """The descriptors of an object as the master describes it (``StoreClient.replicas``)."""
    if meta is None:
        return []
    return [ReplicaDescriptor(ReplicaStatus.COMPLETE,
                              MemoryDescriptor(Descriptor(meta.size, r.offset, r.node)), r.tier)
            for r in meta.replicas]  # fmt: skip


class BufferHandle(bytearray):
    """A value read into memory this process owns (``get_buffer``): a bytearray (so the
    buffer protocol works: ``memoryview(handle)``) with Mooncake's ``ptr()`` and ``size()``."""

    def ptr(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self)) if len(self) else 0

    def size(self) -> int:
        return len(self)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
         "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}  # fmt: skip


def mooncake_size(value: object) -> int:
    """Bytes from an int or a size as Mooncake writes it (``"16 MB"`` is 16 MiB, as in its
    ``string_to_byte_size``); ValueError otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a size must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value)) if isinstance(value, str) else None
    if m is None or (m.group(2) or "").upper() not in _UNIT:
        raise ValueError(f"cannot parse size {value!r} (e.g. 16777216, '16 MB', '1.5 GB')")
    return int(float(m.group(1)) * _UNIT[(m.group(2) or "").upper()])
