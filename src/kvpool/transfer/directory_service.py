"""The segment directory as RPC methods, so that any RpcServer can serve it: the store master
does, which makes ``kvpool store master`` the one thing a host needs (``rpc://HOST:PORT`` in a
``directory`` setting; ``RpcDirectory`` in ``metadata.py`` is the client).

The same rules as the HTTP metadata service: descriptors are validated, a descriptor's host
must be the caller's address (or, from loopback, an address of this host), an entry is renewed,
replaced or withdrawn only with the owner key it was published with, and the name of a dead
owner is handed over.
"""

from __future__ import annotations

import math

from kvpool.common.errors import BadRequestError
from kvpool.common.net import host_matches
from kvpool.common.rpc import current_call, rpc_method
from kvpool.transfer.descriptor_table import DescriptorTable
from kvpool.transfer.segment import SegmentDescriptor

MAX_TTL = 3600.0


def _owner_key(value: object) -> str:
    if not isinstance(value, str) or not 16 <= len(value) <= 128:
        raise BadRequestError("owner_key must be a string of 16..128 characters")
    return value


class DirectoryService:
    """``dir_put`` / ``dir_get`` / ``dir_list`` / ``dir_delete`` over one DescriptorTable."""

    def __init__(self, table: DescriptorTable | None = None) -> None:
        self.table = table if table is not None else DescriptorTable()

    @rpc_method
    def dir_put(self, descriptor: dict, owner_key: str, ttl: float | None = None) -> bool:
        """Publish or renew (``AlreadyExistsError`` if another live owner holds the name)."""
        desc = SegmentDescriptor.from_dict(descriptor)
        if ttl is not None and not (isinstance(ttl, int | float) and 0 < ttl <= MAX_TTL
                                    and math.isfinite(ttl)):  # fmt: skip
            raise BadRequestError(f"ttl must be a number of seconds in (0, {MAX_TTL:g}]")
        peer = current_call().peer
        if peer != "in-process" and not host_matches(desc.host, peer.rpartition(":")[0]):
            raise BadRequestError(
                f"descriptor host {desc.host!r} is not the address this call came from",
                param="host",
            )
        self.table.put(desc, _owner_key(owner_key), ttl)
        return True

    @rpc_method
    def dir_get(self, name: str) -> dict | None:
        if not isinstance(name, str):
            raise BadRequestError("name must be a string")
        desc = self.table.get(name)
        return None if desc is None else desc.to_dict()

    @rpc_method
    def dir_list(self) -> list[dict]:
        return [d.to_dict() for d in self.table.all()]

    @rpc_method
    def dir_delete(self, name: str, owner_key: str) -> bool:
        """Withdraw ``name`` if ``owner_key`` is the one it was published with."""
        if not isinstance(name, str):
            raise BadRequestError("name must be a string")
        return self.table.delete(name, _owner_key(owner_key))
