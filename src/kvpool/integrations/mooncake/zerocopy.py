"""Zero-copy calls of ``MooncakeDistributedStore``: values to and from registered memory,
whole, in parts (several buffers per value) and in byte ranges."""

from __future__ import annotations

from typing import Any

from kvpool.common.errors import BadRequestError
from kvpool.integrations.mooncake.codes import (
    INVALID_PARAMS,
    OK,
    TRANSFER_FAIL,
    put_code,
    returns_code,
)


class ZeroCopy:
    """Mixin of ``MooncakeDistributedStore`` (``_call``, ``_options``, ``buffers``)."""

    @returns_code
    def register_buffer(self, buffer_ptr, size: int | None = None) -> int:
        self.buffers.add(buffer_ptr, size)
        return OK

    @returns_code
    def unregister_buffer(self, buffer_ptr) -> int:
        self.buffers.remove(buffer_ptr)
        return OK

    # -- whole values -------------------------------------------------------------------------

    def put_from(self, key: str, buffer_ptr, size: int, config: Any = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(self, key: str, buffer_ptr, size: int, config: Any = None) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: list[str], buffer_ptrs: list, sizes: list[int],
                       config: Any = None) -> list[int]:  # fmt: skip
        return self._put_from(keys, [[p] for p in buffer_ptrs], [[n] for n in sizes], config,
                              False)  # fmt: skip

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list, sizes: list[int],
                          config: Any = None) -> list[int]:  # fmt: skip
        return self._put_from(keys, [[p] for p in buffer_ptrs], [[n] for n in sizes], config,
                              True)  # fmt: skip

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list],
                                     all_sizes: list[list[int]], config: Any = None) -> list[int]:  # fmt: skip
        """Each value is the concatenation of its buffers."""
        return self._put_from(keys, all_buffer_ptrs, all_sizes, config, False)

    def _put_from(
        self, keys, ptrs: list[list], sizes: list[list], config, upsert: bool
    ) -> list[int]:
        if not len(keys) == len(ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        codes, idx, parts = self._regions(ptrs, sizes, writable=False)
        if idx:
            todo = [keys[i] for i in idx]
            res = self._call("put_from", lambda c: c.batch_put_parts(
                todo, parts, self._replicas(config), options=self._options(config, upsert)))  # fmt: skip
            for i, r in zip(idx, res if isinstance(res, list) else [res] * len(idx), strict=True):
                codes[i] = put_code(r)
        return codes

    def get_into(self, key: str, buffer_ptr, size: int) -> int:
        """Bytes read into registered memory, or a negative code."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list, sizes: list[int]) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        codes, idx, views = self.buffers.views(buffer_ptrs, sizes, writable=True)
        if idx:
            got = self._call("get_into", lambda c: c.batch_get_into([keys[i] for i in idx], views))
            for i, n in zip(idx, got if isinstance(got, list) else [got] * len(idx), strict=True):
                codes[i] = n if n >= 0 else self._why_not_read(keys[i], sizes[i])
        return codes

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list],
                                     all_sizes: list[list[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:  # fmt: skip
        """Each value into its buffers, which together must be exactly its size."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        codes, idx, parts = self._regions(all_buffer_ptrs, all_sizes, writable=True)
        if idx:
            got = self._call("get_into", lambda c: c.batch_get_into_parts(
                [keys[i] for i in idx], parts))  # fmt: skip
            for i, n in zip(idx, got if isinstance(got, list) else [got] * len(idx), strict=True):
                codes[i] = n if n >= 0 else self._why_not_read(keys[i], sum(all_sizes[i]))
        return codes

    def _regions(self, ptrs: list[list], sizes: list[list], writable: bool):
        """(codes, indexes of the items whose buffers are all registered, their views)."""
        codes, idx, out = [INVALID_PARAMS] * len(ptrs), [], []
        for i, (ps, ns) in enumerate(zip(ptrs, sizes, strict=True)):
            if len(ps) != len(ns) or not ps:
                continue
            _, ok, views = self.buffers.views(ps, ns, writable)
            if len(ok) == len(ps):
                idx.append(i)
                out.append(views)
        return codes, idx, out

    def _why_not_read(self, key: str, size: int) -> int:
        """Classify a failed read: missing, buffer too small (INVALID_PARAMS, as Mooncake
        answers), or a transfer failure."""
        have = self.get_size(key)
        return have if have < 0 else INVALID_PARAMS if have > size else TRANSFER_FAIL

    # -- byte ranges --------------------------------------------------------------------------

    def get_into_ranges(self, buffer_ptrs: list, all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]],
                        all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:  # fmt: skip
        """For buffer ``i``, key ``j``, range ``k``: bytes ``[src, src + size)`` of the key's
        value into the buffer at ``dst``; per range the bytes read or a negative code. Ranges
        are not checked against the value's checksum (only whole values can be)."""
        out = []
        for i, base in enumerate(buffer_ptrs):
            per_key = []
            for j, key in enumerate(all_keys[i]):
                dsts, srcs, ns = all_dst_offsets[i][j], all_src_offsets[i][j], all_sizes[i][j]
                per_key.append(self._ranges_of(key, base, dsts, srcs, ns))
            out.append(per_key)
        return out

    def _ranges_of(self, key: str, base: int, dsts: list, srcs: list, ns: list) -> list[int]:
        if not len(dsts) == len(srcs) == len(ns):
            return [INVALID_PARAMS] * len(ns)
        try:
            views = [(s, self.buffers.view(base + d, n, True)) for d, s, n in zip(dsts, srcs, ns,
                                                                                  strict=True)]  # fmt: skip
        except BadRequestError:
            return [INVALID_PARAMS] * len(ns)
        got = self._call("get_into_ranges", lambda c: c.get_ranges(key, views))
        return list(ns) if isinstance(got, int) and got >= 0 else [got] * len(ns)
