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
then keep their shares, as without the ledger. Every process that created or opened a ledger
holds a shared ``flock`` on it; a new ledger's creator first removes the ones nobody holds (a
``kvpool serve`` killed with SIGKILL could not unlink its own).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
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


NAME = re.compile(r"kvpool-cores-\d+-[0-9a-f]{8}")  # the files ``create_ledger`` names
_held: dict[str, int] = {}  # path -> fd: ledgers this process created, locked until released


def create_ledger(slots: int, cores: int, directory: str | None = None) -> Path:
    """A new ledger file for ``slots`` workers over ``cores`` cores, every worker idle (in
    ``/dev/shm`` where it exists: the file is read before every step). This process holds a
    shared lock on it until ``release_ledger`` (or its exit), as each worker does while it has
    it open: ledgers nobody holds any more (their ``kvpool serve`` was killed with SIGKILL) are
    removed here first (``sweep_stale``)."""
    if not 1 <= slots <= MAX_SLOTS or cores < 1:
        raise ValueError(f"a core ledger needs 1-{MAX_SLOTS} slots and >= 1 core")
    where = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    sweep_stale(where)
    name = f"kvpool-cores-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    aside, path = Path(where) / f".{name}", Path(where) / name
    fd = os.open(aside, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:  # locked before its name can be swept
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.write(fd, HEADER.pack(MAGIC, VERSION, slots, cores) + bytes(slots))
        os.rename(aside, path)
    except BaseException:
        os.close(fd)
        aside.unlink(missing_ok=True)
        raise
    _held[str(path)] = fd
    return path


def release_ledger(path: str | os.PathLike) -> None:
    """Drop this process's lock on a ledger it created (unlinked or handed over)."""
    fd = _held.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def sweep_stale(directory: str) -> int:
    """Remove the ledgers ``create_ledger`` named in ``directory`` that no process holds (every
    process that created or opened one keeps a shared lock on it); returns how many."""
    removed = 0
    try:
        entries = [e.path for e in os.scandir(directory) if NAME.fullmatch(e.name)]
    except OSError:
        return 0
    for path in entries:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone already, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held, now = os.fstat(fd), os.stat(path)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(path)
                removed += 1
        except OSError:  # locked: in use (or gone meanwhile)
            pass
        finally:
            os.close(fd)
    return removed


def open_ledger(path: str | os.PathLike, slot: int, share: int, slots: int = 0) -> CoreLedger:
    """The ledger at ``path``, created first when ``slots`` > 0 and it does not exist yet
    (workers started one by one on a host, ``kvpool worker --core-ledger``): written aside, then
    linked into place, so a worker starting at the same moment sees the whole file or none and
    the first creator wins. A ledger of another slot count is refused."""
    path = Path(path)
    made = None
    if slots > 0 and not path.exists():
        made = create_ledger(slots, host_cores(), str(path.parent))
        try:
            os.link(made, path)
        except FileExistsError:
            pass
        finally:
            made.unlink()
    try:
        ledger = CoreLedger(path, slot, share)
    finally:
        if made is not None:
            release_ledger(made)  # the worker's own lock holds the file from here
    if slots > 0 and ledger.slots != slots:
        ledger.close()
        raise ValueError(f"{path}: a ledger of {ledger.slots} slots, not {slots}")
    return ledger


class CoreLedger:
    """One worker's view of its host's ledger: ``begin_step`` before a step, ``idle`` when its
    queue empties."""

    def __init__(self, path: str | os.PathLike, slot: int, share: int) -> None:
        self._lock = os.open(path, os.O_RDONLY)  # shared: the file is in use (``sweep_stale``)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            self._open(path, slot)
        except BaseException:
            os.close(self._lock)
            raise
        self.path = Path(path)
        self.share = max(1, share)  # the threads the worker has when every worker is busy
        self.threads = self.share
        self.reserve = 0  # threads left to the worker's KV loads (``leave``)
        self.widened_steps = 0  # steps run on more threads than the share
        self.step_wide = False  # the current step ran on more threads than the share, so far

    def _open(self, path: str | os.PathLike, slot: int) -> None:
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
        self.slots, self.cores, self.slot = slots, cores, HEADER.size + slot

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
        want = max(1, want - self.reserve)
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
        self.threads = want
        self.step_wide = self.step_wide or want > self.share
        return want

    def leave(self, threads: int) -> None:
        """From now on, step on ``threads`` fewer threads than the ledger gives (never fewer
        than one): the engine leaves one to its loads while they are in flight
        (``engine/loads_in_flight.py``)."""
        if threads != self.reserve:
            self.reserve = max(0, threads)
            self.adjust()

    def idle(self) -> None:
        """Nothing left to step: the other workers may take this one's cores."""
        self._map[self.slot] = 0

    def close(self) -> None:
        if not self._map.closed:
            self._map[self.slot] = 0
            self._map.close()
            os.close(self._lock)
