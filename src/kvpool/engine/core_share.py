"""The cores of one host, shared by the workers on it (``kvpool serve``'s embedded cluster).

``kvpool serve`` gives each of its N workers ``cores // N`` torch threads. When one of them has
nothing to do (a prefill worker whose prompts were all pool hits, a decode worker between
bursts), its cores idle while the other steps on its share. The ledger is a small shared file
with one byte per worker, 1 while that worker has requests; before each step a worker marks
itself busy, counts the busy ones and steps on ``cores // busy`` threads (at least its share):
alone, it takes every core; when the other wakes, both go back to their shares from their next
step on. A step already running when the other wakes narrows before its next layer: the prompt
path asks the ledger between layers (``LlamaModel.between_layers``), the fused decode step reads
the file itself (``DecodeModel.share_cores``, kernels/decode.cpp: a decode step run on two
threads while another process computed on one of the two cores took 2.5x its time, and its
slowest steps 3x those of one thread). So two workers overlap by at most one layer.

The file's layout (little-endian): magic ``KVPC``, version (u16), slots (u16), cores (u32),
then one byte per slot. A worker whose process dies while busy leaves its byte at 1: the others
then keep their shares, as without the ledger.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import uuid
from pathlib import Path

import torch

MAGIC = b"KVPC"
VERSION = 1
HEADER = struct.Struct("<4sHHI")
MAX_SLOTS = 256


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def create_ledger(slots: int, cores: int, directory: str | None = None) -> Path:
    """A new ledger file for ``slots`` workers over ``cores`` cores, every worker idle (in
    ``/dev/shm`` where it exists: the file is read before every step)."""
    if not 1 <= slots <= MAX_SLOTS or cores < 1:
        raise ValueError(f"a core ledger needs 1-{MAX_SLOTS} slots and >= 1 core")
    where = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    path = Path(where) / f"kvpool-cores-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, HEADER.pack(MAGIC, VERSION, slots, cores) + bytes(slots))
    finally:
        os.close(fd)
    return path


def open_ledger(path: str | os.PathLike, slot: int, share: int, slots: int = 0) -> CoreLedger:
    """The ledger at ``path``, created first when ``slots`` > 0 and it does not exist yet
    (workers started one by one on a host, ``kvpool worker --core-ledger``): written aside, then
    linked into place, so a worker starting at the same moment sees the whole file or none and
    the first creator wins. A ledger of another slot count is refused."""
    path = Path(path)
    if slots > 0 and not path.exists():
        made = create_ledger(slots, host_cores(), str(path.parent))
        try:
            os.link(made, path)
        except FileExistsError:
            pass
        finally:
            made.unlink()
    ledger = CoreLedger(path, slot, share)
    if slots > 0 and ledger.slots != slots:
        ledger.close()
        raise ValueError(f"{path}: a ledger of {ledger.slots} slots, not {slots}")
    return ledger


class CoreLedger:
    """One worker's view of its host's ledger: ``begin_step`` before a step, ``idle`` when its
    queue empties."""

    def __init__(self, path: str | os.PathLike, slot: int, share: int) -> None:
        with open(path, "r+b") as f:
            head = f.read(HEADER.size)
            if len(head) != HEADER.size:
                raise ValueError(f"{path}: not a core ledger (too short)")
            magic, version, slots, cores = HEADER.unpack(head)
            if magic != MAGIC or version != VERSION:
                raise ValueError(f"{path}: not a version-{VERSION} core ledger")
            if not 0 <= slot < slots or os.fstat(f.fileno()).st_size != HEADER.size + slots:
                raise ValueError(f"{path}: slot {slot} outside its {slots} slots, or bad size")
            self._map = mmap.mmap(f.fileno(), HEADER.size + slots)
        self.path = Path(path)
        self.slots, self.cores, self.slot = slots, cores, HEADER.size + slot
        self.share = max(1, share)  # the threads the worker has when every worker is busy
        self.threads = self.share
        self.widened_steps = 0  # steps run on more threads than the share
        self.step_wide = False  # the current step ran on more threads than the share, so far

    def attach(self, model) -> None:
        """Have ``model`` (a ``LlamaModel``) ask the ledger between the layers of its steps."""
        if hasattr(model, "between_layers"):
            model.between_layers = self.adjust
        fused = getattr(model, "fused", None)
        if fused is not None and hasattr(fused, "share_cores"):
            fused.share_cores(str(self.path), HEADER.size, self.slots, self.cores, self.share)

    def _busy_count(self) -> int:
        return sum(self._map[HEADER.size:HEADER.size + self.slots])  # fmt: skip

    def begin_step(self) -> int:
        """Mark this worker busy and set torch's threads for the step about to run; returns
        them."""
        self._map[self.slot] = 1
        self.step_wide = False
        want = self.adjust()
        if want > self.share:
            self.widened_steps += 1
        return want

    def adjust(self) -> int:
        """Torch's threads for what the other workers do now (the prompt path calls this
        between layers, so a wide prompt step narrows within a layer of another worker
        waking, and widens when the others go idle); returns them."""
        want = max(self.share, self.cores // max(1, self._busy_count()))
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
        self.threads = want
        self.step_wide = self.step_wide or want > self.share
        return want

    def idle(self) -> None:
        """Nothing left to step: the other workers may take this one's cores."""
        self._map[self.slot] = 0

    def close(self) -> None:
        if not self._map.closed:
            self._map[self.slot] = 0
            self._map.close()
