"""Torch tensors as pool values, in the layout Mooncake Store writes (as observed in the bytes
of its 0.3.13 wheel, so a value put by either is read by the other): a 304-byte header, then
the tensor's bytes.

Header, little-endian: ``u32 0x4D4F4F4E`` (``b"NOOM"``), ``u16`` version 1, ``u16`` header size
304, ``i32`` dtype code, ``i32`` ndim (0..8), ``u64`` 0, ``u64`` data offset (304), ``u64`` data
bytes, ``i64[8]`` shape, ``i64[8]`` shape (the one that is read; unused dimensions -1),
``u64`` 0, zeros to 304. Mooncake has no code for complex dtypes: they are refused, as there.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from kvpool.common.errors import BadRequestError

MAGIC, VERSION, HEADER_BYTES, MAX_DIMS = 0x4D4F4F4E, 1, 304, 8
_HEAD = struct.Struct("<IHHiiQQQ8q8qQ")
DTYPES = {torch.float32: 0, torch.float64: 1, torch.int8: 2, torch.uint8: 3, torch.int16: 4,
          torch.uint16: 5, torch.int32: 6, torch.uint32: 7, torch.int64: 8, torch.uint64: 9,
          torch.bool: 10, torch.float16: 11, torch.bfloat16: 12, torch.float8_e4m3fn: 13,
          torch.float8_e5m2: 14}  # fmt: skip
_BY_CODE = {code: dtype for dtype, code in DTYPES.items()}


def header(tensor: torch.Tensor) -> bytes:
    """The header of ``tensor`` (a CPU tensor of a supported dtype, at most 8 dimensions)."""
    if not isinstance(tensor, torch.Tensor):
        raise BadRequestError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise BadRequestError("only CPU tensors (kvpool has no GPU path)")
    if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
        raise BadRequestError(f"unsupported tensor: dtype {tensor.dtype}, {tensor.dim()} dims")
    dims = list(tensor.shape) + [-1] * (MAX_DIMS - tensor.dim())
    nbytes = tensor.numel() * tensor.element_size()
    head = _HEAD.pack(MAGIC, VERSION, HEADER_BYTES, DTYPES[tensor.dtype], tensor.dim(), 0,
                      HEADER_BYTES, nbytes, *dims, *dims, 0)  # fmt: skip
    return head.ljust(HEADER_BYTES, b"\0")


def parts(tensor: torch.Tensor) -> list:
    """``[header, data]`` of a tensor value (the data viewed, not copied, when contiguous)."""
    head = header(tensor)  # validates it first
    t = tensor.detach().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return [head, data]


def parse(buf) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, data bytes) of a value's header; BadRequestError if it is not one or
    ``buf`` is shorter than the value it announces."""
    view = memoryview(buf)
    if view.nbytes < HEADER_BYTES:
        raise BadRequestError("too short for a tensor value")
    magic, version, size, code, ndim, zero, offset, nbytes, *rest = _HEAD.unpack_from(
        bytes(view[: _HEAD.size])
    )
    shape, reserved = list(rest[MAX_DIMS : 2 * MAX_DIMS][:ndim]), rest[-1]
    if (magic, version, size, offset, zero, reserved) != (MAGIC, VERSION, HEADER_BYTES,
                                                          HEADER_BYTES, 0, 0) \
            or code not in _BY_CODE or not 0 <= ndim <= MAX_DIMS or any(d < 0 for d in shape):  # fmt: skip
        raise BadRequestError("not a tensor value")
    dtype = _BY_CODE[code]
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != nbytes:
        raise BadRequestError("tensor header does not match its data length")
    if view.nbytes < HEADER_BYTES + nbytes:
        raise BadRequestError("tensor value is truncated")
    return dtype, shape, nbytes


def view(buf, dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
    """A tensor over the data part of a value read into ``buf`` (header included)."""
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    data = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES)
    return data.view(dtype).reshape(shape)
