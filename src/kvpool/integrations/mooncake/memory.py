"""Memory registered with a Mooncake store (``register_buffer``): the only memory its
zero-copy calls read or write. A pointer or range outside it is refused (INVALID_PARAMS)
where Mooncake's TCP transport would read or write whatever is there."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from kvpool.common.errors import BadRequestError
from kvpool.integrations.mooncake.codes import INVALID_PARAMS, logger
from kvpool.transfer.segment import byte_view


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
