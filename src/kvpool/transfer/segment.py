"""Registered memory segments and their descriptors.

A segment is a named, contiguous byte range a process owns and lets peers read and write. It
is backed either by a shared-memory file (``/dev/shm``, so a same-host peer can map it and copy
without any socket) or by memory the caller already has (a numpy array or CPU tensor; reachable
over TCP only). The descriptor is what the segment directory publishes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import socket
import stat
import uuid
from dataclasses import asdict, dataclass

import numpy as np

from kvpool.common.errors import BadRequestError

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvpool-"
# what new_shm_name makes: a plain file name inside SHM_DIR, nothing that could leave it
SHM_NAME = re.compile(r"kvpool-[0-9]{1,10}-[0-9a-f]{8}-[A-Za-z0-9_-]{0,40}")
_HOST = re.compile(r"[A-Za-z0-9._:%-]{1,255}")
_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_SEGMENT_BYTES = 1 << 50


def boot_id() -> str:
    """Identifies this host's running kernel: equal boot ids share ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


@dataclass(slots=True, frozen=True)
class SegmentDescriptor:
    """Everything a peer needs to reach a segment (published in the directory)."""

    name: str
    size: int
    host: str
    port: int
    segment_id: int
    owner_id: str
    pid: int
    boot_id: str
    shm_name: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> SegmentDescriptor:
        """A validated descriptor (``BadRequestError`` for anything a peer should not trust:
        a shm name that is not a plain kvpool file name, a size or id out of range, ...)."""
        if not isinstance(data, dict):
            raise BadRequestError("malformed segment descriptor: not an object")
        try:
            desc = cls(**{f: data[f] for f in cls.__dataclass_fields__ if f in data})
        except TypeError as exc:
            raise BadRequestError(f"malformed segment descriptor: {exc}") from exc
        desc.validate()
        return desc

    def validate(self) -> None:
        def bad(field: str, why: str) -> BadRequestError:
            return BadRequestError(f"segment descriptor field {field} {why}", param=field)

        for field, lo, hi in (("size", 1, MAX_SEGMENT_BYTES), ("port", 0, 65535),
                              ("segment_id", 1, 2**32 - 1), ("pid", 1, 2**31 - 1)):  # fmt: skip
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise bad(field, f"must be an integer in [{lo}, {hi}]")
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 255 or "\0" in self.name:
            raise bad("name", "must be 1..255 characters, no NUL")
        if not isinstance(self.host, str) or not _HOST.fullmatch(self.host):
            raise bad("host", "must be a host name or an IP address")
        for field in ("owner_id", "boot_id"):
            if not isinstance(getattr(self, field), str) or not _ID.fullmatch(getattr(self, field)):
                raise bad(field, "must be 1..64 letters, digits, '-', '_' or '.'")
        if self.shm_name is not None and not (
            isinstance(self.shm_name, str) and SHM_NAME.fullmatch(self.shm_name)
        ):
            raise bad("shm_name", f"must be a plain kvpool shared-memory name in {SHM_DIR}")


class SharedRegion:
    """A file mapped into this process: a ``/dev/shm/<shm_name>`` created by its owner and
    opened by same-host peers, or (``path``) a file of the owner's own, such as an SSD tier,
    which peers reach over TCP only.

    A peer opens only a plain kvpool name inside ``/dev/shm`` (no path, no symlink), and only
    a regular file of its own user, so a forged descriptor cannot make it map another file.
    """

    def __init__(self, shm_name: str | None, size: int, *, create: bool,
                 path: str | None = None) -> None:  # fmt: skip
        if size <= 0:
            raise BadRequestError("a shared segment needs a size > 0")
        if path is None and not (isinstance(shm_name, str) and SHM_NAME.fullmatch(shm_name)):
            raise BadRequestError(f"not a kvpool shared-memory name: {shm_name!r}")
        self.shm_name = shm_name if path is None else None
        self.path = path or os.path.join(SHM_DIR, shm_name)  # type: ignore[arg-type]
        self.size = size
        self.owner = create
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise BadRequestError(f"cannot open segment file {self.path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not create and (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()):
                raise BadRequestError(f"{self.path} is not a regular file of this user")
            if create:
                os.ftruncate(fd, size)
            elif st.st_size < size:
                raise BadRequestError(f"shared segment {self.path} is smaller than {size} bytes")
            self.mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mmap, dtype=np.uint8)

    def close(self) -> None:
        """Unmap (when no view is alive) and, for the owner, remove the file."""
        self.array = None  # type: ignore[assignment]
        # with views still exported the mapping goes away with the last one
        with contextlib.suppress(BufferError):
            self.mmap.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def new_shm_name(segment_name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in segment_name)[:40]
    return f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{safe}"


def reap_stale_shm() -> int:
    """Remove ``/dev/shm/kvpool-<pid>-*`` files whose owner process no longer exists."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        pid_text = name[len(SHM_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def owner_is_dead(desc: SegmentDescriptor, timeout: float = 1.0) -> bool:
    """Whether the process that published ``desc`` is gone (same host: its pid; otherwise its
    transfer server refuses connections)."""
    if desc.boot_id == boot_id():
        return not pid_alive(desc.pid)
    try:
        socket.create_connection((desc.host, desc.port), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # unreachable is not dead: a network problem must not steal names
    return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def byte_view(buf: object, *, writable: bool) -> memoryview:
    """A flat, C-contiguous ``uint8`` memoryview of a buffer, numpy array or CPU tensor."""
    if type(buf) is np.ndarray and buf.dtype == np.uint8 and buf.ndim == 1:  # the hot case
        if not buf.flags.c_contiguous:
            raise BadRequestError("buffer must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise BadRequestError("buffer is read-only but the transfer writes into it")
        return memoryview(buf)
    if hasattr(buf, "untyped_storage") and hasattr(buf, "is_contiguous"):  # torch.Tensor
        if buf.device.type != "cpu" or not buf.is_contiguous():  # type: ignore[attr-defined]
            raise BadRequestError("a tensor buffer must be a contiguous CPU tensor")
        buf = buf.reshape(-1).view(dtype=_torch_uint8()).numpy()  # type: ignore[attr-defined]
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]
    except TypeError as exc:
        raise BadRequestError(f"not a buffer: {type(buf).__name__}") from exc
    if not mv.c_contiguous:
        raise BadRequestError("buffer must be C-contiguous")
    if writable and mv.readonly:
        raise BadRequestError("buffer is read-only but the transfer writes into it")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _torch_uint8():
    import torch

    return torch.uint8


class Segment:
    """A segment this process owns: its bytes as a memoryview and a ``uint8`` numpy array."""

    def __init__(
        self, name: str, segment_id: int, view: memoryview, region: SharedRegion | None, keep=None
    ) -> None:
        self.name = name
        self.segment_id = segment_id
        self.view = view
        self.size = len(view)
        self.region = region
        self._keep = keep  # the caller's object, kept alive as long as the segment

    @property
    def array(self) -> np.ndarray:
        return np.frombuffer(self.view, dtype=np.uint8)

    @property
    def shm_name(self) -> str | None:
        return self.region.shm_name if self.region else None

    def tensor(self, dtype, shape: tuple[int, ...]):
        """A torch tensor viewing (not copying) the segment's first bytes."""
        import torch

        t = torch.frombuffer(self.view, dtype=torch.uint8)
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if n > self.size:
            raise BadRequestError(f"shape {shape} needs {n} bytes, segment has {self.size}")
        return t[:n].view(dtype).view(shape)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # the caller may still hold views of it
            self.view.release()
        if self.region is not None:
            self.region.close()
        self._keep = None
