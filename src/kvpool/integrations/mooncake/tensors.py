"""Torch tensors as pool values: a 128-byte header (magic ``KVPT``, version, dtype, shape,
data length), then the tensor's bytes. The layout is kvpool's own: a buffer written by
Mooncake's ``put_tensor_from`` layout is not readable here, and the reverse."""

from __future__ import annotations

import struct

import numpy as np
import torch

from kvpool.common.errors import BadRequestError

MAGIC, VERSION, HEADER_BYTES, MAX_DIMS = b"KVPT", 1, 128, 8
_HEAD = struct.Struct("<4sHHii8qQ")  # magic, version, header size, dtype, ndim, dims, data bytes
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]  # fmt: skip


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
    head = _HEAD.pack(MAGIC, VERSION, HEADER_BYTES, DTYPES.index(tensor.dtype), tensor.dim(),
                      *dims, nbytes)  # fmt: skip
    return head.ljust(HEADER_BYTES, b"\0")


def parts(tensor: torch.Tensor) -> list:
    """``[header, data]`` of a tensor value (the data viewed, not copied, when contiguous)."""
    head = header(tensor)  # validates it first
    t = tensor.detach().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return [head, data]


def parse(buf) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, data bytes) of a value's header; BadRequestError if it is not one."""
    raw = bytes(memoryview(buf)[:HEADER_BYTES])
    if len(raw) < _HEAD.size:
        raise BadRequestError("too short for a tensor value")
    magic, version, size, dtype, ndim, *rest = _HEAD.unpack_from(raw)
    dims, nbytes = rest[:MAX_DIMS], rest[MAX_DIMS]
    if magic != MAGIC or version != VERSION or size != HEADER_BYTES or not 0 <= dtype < len(DTYPES) \
            or not 0 <= ndim <= MAX_DIMS or any(d < 0 for d in dims[:ndim]):  # fmt: skip
        raise BadRequestError("not a kvpool tensor value")
    shape = list(dims[:ndim])
    want = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=DTYPES[dtype]).element_size()
    if want != nbytes:
        raise BadRequestError("tensor header does not match its data length")
    return DTYPES[dtype], shape, nbytes


def view(buf, dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
    """A tensor over the data part of a value read into ``buf`` (header included)."""
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    data = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES)
    return data.view(dtype).reshape(shape)
