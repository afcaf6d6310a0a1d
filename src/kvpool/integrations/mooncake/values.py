"""Values by key (the part of ``MooncakeDistributedStore`` that copies): put, upsert, get,
buffers, existence, sizes, removal, replica descriptors."""

from __future__ import annotations

from typing import Any

from kvpool.integrations.mooncake.codes import OK, put_code
from kvpool.integrations.mooncake.types import BufferHandle, replica_descriptors
from kvpool.protocol.store import ObjectDesc
from kvpool.transfer.segment import byte_view


class Values:
    """Mixin of ``MooncakeDistributedStore`` (``_call``, ``_options`` and ``_client``)."""

    # -- put and upsert ------------------------------------------------------------------------

    def put(self, key: str, value, config: Any = None) -> int:
        return self.put_batch([key], [value], config)

    def put_parts(self, key: str, *parts, config: Any = None) -> int:
        return self._put_many([key], [list(parts)], config, upsert=False)[0]

    def put_batch(self, keys: list[str], values: list, config: Any = None) -> int:
        """0, or the first error; an existing key is success and keeps its first value."""
        codes = self._put_many(keys, [[v] for v in values], config, upsert=False)
        return next((c for c in codes if c != OK), OK)

    def upsert(self, key: str, value, config: Any = None) -> int:
        return self.upsert_batch([key], [value], config)

    def upsert_parts(self, key: str, *parts, config: Any = None) -> int:
        return self._put_many([key], [list(parts)], config, upsert=True)[0]

    def upsert_batch(self, keys: list[str], values: list, config: Any = None) -> int:
        """0, or the first error; existing keys get the new values."""
        codes = self._put_many(keys, [[v] for v in values], config, upsert=True)
        return next((c for c in codes if c != OK), OK)

    def _put_many(self, keys: list[str], parts: list[list], config: Any, upsert: bool) -> list[int]:
        """Per key a code; values given as lists of buffers (concatenated)."""

        def run(c):
            views = [[byte_view(p, writable=False) for p in ps] for ps in parts]
            return c.batch_put_parts(list(keys), views, self._replicas(config),
                                     options=self._options(config, upsert))  # fmt: skip

        results = self._call("put", run)
        return [put_code(r) for r in results] if isinstance(results, list) else \
            [results] * len(keys)  # fmt: skip

    # -- get ----------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when missing (or unreadable)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        values = self._call("get", lambda c: c.batch_get(list(keys)))
        return [v or b"" for v in values] if isinstance(values, list) else [b""] * len(keys)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value in memory this process owns, or None when missing."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        got = self._call("get_buffer", lambda c: c.batch_get_as(list(keys), BufferHandle))
        return got if isinstance(got, list) else [None] * len(keys)

    # -- what is there ----------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        found = self._call("is_exist", lambda c: c.batch_exists(list(keys)))
        return [int(f) for f in found] if isinstance(found, list) else [-1] * len(keys)

    def get_size(self, key: str) -> int:
        return self._call("get_size", lambda c: c.get_size(key))

    def get_replica_desc(self, key: str) -> list:
        """The replicas of ``key`` (``[]`` when it is missing)."""
        meta = self._call("get_replica_desc", lambda c: c.replicas(key))
        return replica_descriptors(meta) if isinstance(meta, ObjectDesc) else []

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list]:
        """``{key: replicas}`` for the keys that exist."""
        out = {k: self.get_replica_desc(k) for k in keys}
        return {k: v for k, v in out.items() if v}

    # -- removal ------------------------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> int:
        return self._call("remove", lambda c: c.remove(key, force)) or OK

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return [self.remove(k, force) for k in keys]

    def remove_all(self, force: bool = False) -> int:
        """How many objects went (leased ones stay unless ``force``, an admin call)."""
        return self._call("remove_all", lambda c: c.remove_matching(None, force))

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many objects whose keys match went; INVALID_PARAMS for a bad pattern."""
        return self._call("remove_by_regex", lambda c: c.remove_matching(regex_pattern, force))
