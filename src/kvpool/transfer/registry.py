"""The segments a process owns: allocation or adoption of memory, ids, publication by name."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import numpy as np

from kvpool.common.errors import BadRequestError, KVPoolError, NotFoundError
from kvpool.transfer.metadata import SegmentDirectory
from kvpool.transfer.segment import (
    Segment,
    SegmentDescriptor,
    SharedRegion,
    boot_id,
    byte_view,
    new_shm_name,
)

logger = logging.getLogger(__name__)


class SegmentRegistry:
    """Segments by name and by id (the id travels in TCP frames), published in ``directory``."""

    def __init__(self, directory: SegmentDirectory, owner_id: str) -> None:
        self.directory = directory
        self.owner_id = owner_id
        self.address = ("127.0.0.1", 0)  # (host, port) peers dial; set once the server runs
        self._lock = threading.Lock()
        self._by_id: dict[int, Segment] = {}
        self._by_name: dict[str, Segment] = {}
        self._next_id = 1

    def register(
        self,
        name: str,
        buffer: object = None,
        *,
        size: int | None = None,
        shared: bool = True,
        path: str | None = None,
    ) -> Segment:
        """Register memory under a cluster-wide ``name`` and publish it.

        Without ``buffer``, allocates ``size`` bytes (in shared memory unless ``shared`` is
        False, so same-host peers copy without sockets). With ``buffer`` (numpy array, CPU
        tensor, bytearray...), registers that memory as is: peers reach it over TCP.
        """
        if not name or len(name) > 255 or "\0" in name:
            raise BadRequestError("a segment name must be 1..255 characters, no NUL")
        region = None
        if buffer is None:
            if size is None or size <= 0:
                raise BadRequestError("register() needs a buffer or a size > 0")
            if path is not None:  # a file (e.g. on an SSD) mapped like shared memory
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                region = SharedRegion(None, size, create=True, path=os.path.abspath(path))
                view = memoryview(region.mmap)
            elif shared:
                region = SharedRegion(new_shm_name(name), size, create=True)
                view = memoryview(region.mmap)
            else:
                buffer = np.zeros(size, dtype=np.uint8)
        if region is None:
            view = byte_view(buffer, writable=True)
            if len(view) == 0:
                raise BadRequestError("cannot register an empty buffer")
        with self._lock:
            if name in self._by_name:
                if region is not None:  # the memory allocated above goes back at once
                    with contextlib.suppress(BufferError):
                        view.release()
                    region.close()
                raise BadRequestError(f"segment {name!r} is already registered here")
            seg = Segment(name, self._next_id, view, region, keep=buffer)
            self._next_id += 1
            self._by_id[seg.segment_id] = seg
            self._by_name[name] = seg
        try:
            self._publish(self._descriptor(seg))
        except BaseException:
            self._drop(seg)
            raise
        return seg

    def _publish(self, desc: SegmentDescriptor) -> None:
        """Publish (the directory hands the name over if its previous owner is dead: a
        restarted worker takes its name back)."""
        self.directory.publish(desc)

    def unregister(self, name: str) -> None:
        with self._lock:
            seg = self._by_name.get(name)
        if seg is None:
            raise NotFoundError(f"segment {name!r} is not registered here")
        try:
            self.directory.withdraw(name)
        except KVPoolError as exc:  # an unreachable directory lets the entry expire instead
            logger.warning("segment %s: could not withdraw it: %s", name, exc)
        self._drop(seg)

    def get(self, name: str) -> Segment:
        with self._lock:
            seg = self._by_name.get(name)
        if seg is None:
            raise NotFoundError(f"segment {name!r} is not registered here")
        return seg

    def _drop(self, seg: Segment) -> None:
        with self._lock:
            self._by_id.pop(seg.segment_id, None)
            self._by_name.pop(seg.name, None)
        seg.close()

    def by_id(self, segment_id: int) -> Segment | None:
        return self._by_id.get(segment_id)

    def _descriptor(self, seg: Segment) -> SegmentDescriptor:
        return SegmentDescriptor(
            name=seg.name,
            size=seg.size,
            host=self.address[0],
            port=self.address[1],
            segment_id=seg.segment_id,
            owner_id=self.owner_id,
            pid=os.getpid(),
            boot_id=boot_id(),
            shm_name=seg.shm_name,
        )

    def close(self) -> None:
        """Free every segment (descriptors are withdrawn by the directory's own close)."""
        with self._lock:
            segments = list(self._by_id.values())
        for seg in segments:
            self._drop(seg)
