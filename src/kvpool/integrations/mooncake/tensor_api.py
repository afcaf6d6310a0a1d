"""Tensor calls of ``MooncakeDistributedStore`` (CPU tensors; the value layout is in
``tensors.py``)."""

from __future__ import annotations

from kvpool.common.errors import BadRequestError
from kvpool.integrations.mooncake import tensors
from kvpool.integrations.mooncake.codes import INVALID_PARAMS, logger, put_code


class Tensors:
    """Mixin of ``MooncakeDistributedStore`` (``_call``, ``_options``, ``buffers``)."""

    def put_tensor(self, key: str, tensor) -> int:
        return self.batch_put_tensor([key], [tensor])[0]

    def upsert_tensor(self, key: str, tensor) -> int:
        return self.batch_upsert_tensor([key], [tensor])[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._put_tensors(keys, tensors_list, upsert=False)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._put_tensors(keys, tensors_list, upsert=True)

    def _put_tensors(self, keys: list[str], values: list, upsert: bool) -> list[int]:
        if len(keys) != len(values):
            return [INVALID_PARAMS] * len(keys)
        try:
            parts = [tensors.parts(t) for t in values]
        except BadRequestError as exc:
            logger.warning("mooncake put_tensor: %s", exc)
            return [INVALID_PARAMS] * len(keys)
        res = self._call("put_tensor", lambda c: c.batch_put_parts(
            list(keys), parts, options=self._options(None, upsert)))  # fmt: skip
        return [put_code(r) for r in res] if isinstance(res, list) else [res] * len(keys)

    def get_tensor(self, key: str):
        """The tensor under ``key`` (its own memory), or None."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list:
        got = self._call("get_tensor", lambda c: c.batch_get_as(list(keys), bytearray))
        return [self._tensor(b) for b in got] if isinstance(got, list) else [None] * len(keys)

    @staticmethod
    def _tensor(buf):
        if buf is None:
            return None
        try:
            return tensors.view(buf, *tensors.parse(buf))  # keeps ``buf`` alive
        except BadRequestError as exc:
            logger.warning("mooncake get_tensor: %s", exc)
            return None

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int):
        """The tensor read into registered memory (header, then data: a view of it), or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: list[str], buffer_ptrs: list, sizes: list[int]) -> list:
        n = self.batch_get_into(keys, buffer_ptrs, sizes)
        out = []
        for got, ptr in zip(n, buffer_ptrs, strict=True):
            out.append(self._tensor(self.buffers.view(ptr, got, True)) if got > 0 else None)
        return out

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``size`` bytes of registered memory that hold a tensor value (as
        ``get_tensor_into`` leaves it: header, then data)."""
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list,
                              sizes: list[int]) -> list[int]:  # fmt: skip
        """All or nothing, as Mooncake: one buffer that does not hold exactly a tensor value
        (header, then its data) makes every item INVALID_PARAMS."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        for ptr, n in zip(buffer_ptrs, sizes, strict=True):
            try:
                *_, nbytes = tensors.parse(self.buffers.view(ptr, n, False))
            except BadRequestError as exc:
                logger.warning("mooncake put_tensor_from: %s", exc)
                return [INVALID_PARAMS] * len(keys)
            if nbytes + tensors.HEADER_BYTES != n:
                return [INVALID_PARAMS] * len(keys)
        return self.batch_put_from(keys, buffer_ptrs, sizes)
