"""Keeps pool I/O off the engine step: a local view of what the pool holds, background
lookups that feed it, and a bounded queue of background loads that report when they end.

The view is fed by events: the answers of background lookups, this engine's own finished
saves (present), and loads (what loaded is present; the first block that did not is absent).
Entries expire (the pool evicts; another engine saves), so a stale "present" costs at most one
load that comes back short, and the rest of that prefix is recomputed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.engine.connectors.base import BlockRef

logger = logging.getLogger(__name__)

MAX_VIEW_ENTRIES = 1 << 20
MAX_HINTS = 4096  # arrival lookups queued at once
# The load thread's default nice value: the engine's compute goes first and a load takes what
# is left of busy cores (lookups, short round trips a waiting request needs, are not lowered).
# While the kernels held the GIL through a decode step, the loads ran only between steps and
# their priority hardly mattered to the streams (two 21-round runs of bench_overlap.py: TBT
# p99 1.02x and 1.07x better at nice 5, first tokens 1.40x and 1.68x later), so it was 0. Now
# that the kernels let go of the GIL in steps with loads in flight, the loads run during those
# steps, and at equal priority their thread takes a core from the step's two and every
# barrier waits for it: TBT p99 93.9 ms at nice 0 against 47.9 at nice 5 (docs/benchmarks.md).
# Not every host scheduler keeps a nice-5 thread off busy cores (on an AMX Xeon under Linux
# 6.18: TBT p99 134 ms at nice 5, 147 at nice 0), so the engine also steps on one thread fewer
# while loads are in flight (``engine/loads_in_flight.py``): this thread gets a core.
BACKGROUND_NICE = 5


def _yield_cpu(nice: int = BACKGROUND_NICE) -> None:
    """Lower this thread's CPU priority by ``nice`` (Linux: per thread; 0: unchanged): when
    the cores are busy, the engine's compute then goes first and the I/O takes what is left,
    at the price of the loaded request's first token (``bench_overlap.py`` measures both)."""
    if nice <= 0:
        return
    # not Linux, or not allowed: it runs at normal priority
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class PoolView:
    """block hash -> (in the pool?, until when that is believed, the tier it is in: "dram",
    "ssd", or "" when not known)."""

    def __init__(self, present_ttl: float = 2.0, absent_ttl: float = 0.5) -> None:
        self.present_ttl = present_ttl
        self.absent_ttl = absent_ttl
        self._entries: dict[bytes, tuple[bool, float, str]] = {}
        self._lock = threading.Lock()

    def mark(self, hashes: list[bytes], present: list | bool) -> None:
        """``present``: one flag for all, or per hash a flag or a tier name (None: absent)."""
        now = time.monotonic()
        flags = [present] * len(hashes) if isinstance(present, bool) else present
        with self._lock:
            if len(self._entries) + len(hashes) > MAX_VIEW_ENTRIES:
                self._prune(now)
            for h, p in zip(hashes, flags, strict=True):
                ttl = self.present_ttl if p else self.absent_ttl
                tier = p if isinstance(p, str) else ""
                if p is True:  # present (loaded, saved): where it is stays what was known
                    old = self._entries.get(h)
                    tier = old[2] if old is not None and old[0] else ""
                self._entries[h] = (bool(p), now + ttl, tier)

    def on_ssd(self, hashes: list[bytes]) -> list[bytes]:
        """The hashes believed to be on the SSD tier."""
        with self._lock:
            return [h for h in hashes if (e := self._entries.get(h)) is not None and e[2] == "ssd"]

    def tier(self, hashes: list[bytes]) -> str:
        """The slowest tier believed to hold any of ``hashes`` ("dram" unless one is on SSD)."""
        with self._lock:
            slow = any(e is not None and e[2] == "ssd" for e in map(self._entries.get, hashes))
        return "ssd" if slow else "dram"

    def leading(self, hashes: list[bytes]) -> tuple[int, bool]:
        """(how many leading hashes are believed present, whether the answer is final: False
        when the run ends at a hash the view knows nothing (fresh) about)."""
        now = time.monotonic()
        n = 0
        with self._lock:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is None or entry[1] <= now:
                    return n, False
                if not entry[0]:
                    return n, True
                n += 1
        return n, True

    def _prune(self, now: float) -> None:
        self._entries = {h: e for h, e in self._entries.items() if e[1] > now}
        while len(self._entries) > MAX_VIEW_ENTRIES // 2:  # still full of fresh entries
            self._entries.pop(next(iter(self._entries)))


@dataclass(slots=True)
class _Job:
    request_id: str
    blocks: list[BlockRef]
    block_ids: list[int]
    source: object = None  # a KVHandle: read from the engine that holds the blocks first
    tier: str = "dram"  # where the pool holds them (the slowest tier among them)
    cancelled: bool = False
    queued: float = field(default_factory=time.monotonic)


class Prefetcher:
    """Background lookups and loads for the scheduler side of a connector.

    ``exists(hashes) -> [tier or None]`` asks the pool (a flag per hash also works); ``load(blocks, block_ids) -> int`` fills
    blocks and returns how many leading ones loaded (both run on this object's threads and
    report failures by raising or returning short). ``max_loads``: loads queued or running at
    once (more: the scheduler is told to ask again later). ``nice``: how much lower than the
    engine's the load thread's CPU priority is (lookups keep the engine's).
    """

    def __init__(self, exists: Callable[[list[bytes]], list],
                 load: Callable[[list[BlockRef], list[int], object], int], view: PoolView,
                 max_loads: int = 8, lookup_wait: float = 0.5, lookup_grace: float = 0.005,
                 on_loaded: Callable[[int, float, str], None] | None = None,
                 probe: Callable[[list[bytes]], int] | None = None,
                 nice: int = BACKGROUND_NICE) -> None:  # fmt: skip
        self._exists = exists
        self._nice = nice  # the load thread's priority (see ``_yield_cpu``)
        self._load = load
        self._on_loaded = on_loaded  # (blocks asked, seconds, tier) of each load that ran
        self._probe = probe  # reads blocks (by hash) into scratch memory: how many it read
        self.view = view
        self.max_loads = max_loads
        self.lookup_wait = lookup_wait  # past this, a request goes on with what is known
        self.lookup_grace = lookup_grace  # the step waits this long for a lookup's answer
        self._grace_window, self._grace_left = -1.0, lookup_grace
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._asked: dict[str, float] = {}  # request id -> when its lookup was queued
        # lookups queued when a request arrived (``hint``), by the first hash they ask about:
        # the scheduler waits for that answer instead of asking again
        self._hinted: dict[bytes, threading.Event] = {}
        self._jobs: dict[str, _Job] = {}  # queued or running loads
        self._finished: dict[str, int] = {}
        # a report whose request id already has one waiting (a request aborted during its
        # load and sent again under the same id): it goes out with the next call, so each
        # load's end is reported exactly once and in order (the old load's first: its blocks)
        self._later: list[tuple[str, int]] = []
        self._lookups: queue.SimpleQueue = queue.SimpleQueue()
        self._loads: queue.SimpleQueue = queue.SimpleQueue()
        self.lookups = self.loads = self.cancelled = 0
        self.load_seconds = 0.0  # time loads ran (wall), for the hidden-share figures
        self._threads = [
            threading.Thread(target=self._lookup_loop, name="kvpool-kv-lookup", daemon=True),
            threading.Thread(target=self._load_loop, name="kvpool-kv-load", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- scheduler side -----------------------------------------------------------------------

    def matched_blocks(self, request_id: str, hashes: list[bytes]) -> int | None:
        """Leading blocks of ``hashes`` worth loading now; None: ask again later (a lookup
        is in flight, or the load queue is full)."""
        n, final = self.view.leading(hashes)
        if not final:
            asked = self._asked.get(request_id)
            now = time.monotonic()
            if asked is None:
                self._asked[request_id] = now
                with self._lock:
                    answered = self._hinted.get(hashes[n])
                if answered is None:
                    answered = threading.Event()
                    self._lookups.put((hashes[n:], answered))
                # a lookup takes a round trip to the master: worth a few milliseconds of this
                # step, against a whole step of waiting for the next one (at most
                # ``lookup_grace`` per 50 ms however many requests arrive)
                if now - self._grace_window > 0.05:
                    self._grace_window, self._grace_left = now, self.lookup_grace
                t0 = time.monotonic()
                got = self._grace_left > 0 and answered.wait(self._grace_left)
                self._grace_left -= time.monotonic() - t0
                if not got:
                    return None
                n, final = self.view.leading(hashes)
            elif now - asked < self.lookup_wait:
                return None
        if n and len(self._jobs) >= self.max_loads:
            return None
        return n

    def hint(self, hashes: list[bytes]) -> None:
        """A request with these block hashes arrived (any thread): look them up now, so the
        answer is in the view when the scheduler first considers the request (several
        arrivals during one step are looked up together, none waits a step for its turn)."""
        n, final = self.view.leading(hashes)
        if final or n >= len(hashes):
            return
        with self._lock:
            if hashes[n] in self._hinted:
                return
            if len(self._hinted) >= MAX_HINTS:  # the lookups are behind: the scheduler asks
                return
            answered = self._hinted[hashes[n]] = threading.Event()
        self._lookups.put((hashes[n:], answered))

    def start_load(self, request_id: str, blocks: list[BlockRef], block_ids: list[int],
                   source: object = None, tier: str = "dram") -> None:  # fmt: skip
        job = _Job(request_id, blocks, block_ids, source, tier)
        with self._lock:
            self._jobs[request_id] = job
        self._asked.pop(request_id, None)
        self._loads.put(job)

    def probe(self, hashes: list[bytes], tier: str = "dram") -> None:
        """Read these blocks (in ``tier``) in the background, only to measure (see
        ``FetchPolicy``)."""
        if self._probe is not None and hashes:
            self._loads.put((list(hashes), tier))

    def request_finished(self, request_id: str) -> None:
        self._asked.pop(request_id, None)
        with self._lock:
            job = self._jobs.get(request_id)
            if job is not None:
                job.cancelled = True  # reported (0 blocks) when its turn comes, if not running

    def finished(self) -> dict[str, int]:
        with self._lock:
            out, self._finished = self._finished, {}
            later, self._later = self._later, []
            for rid, n in later:
                if rid in self._finished:
                    self._later.append((rid, n))
                else:
                    self._finished[rid] = n
            if self._finished:
                self._event.set()
        return out

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)
        self._event.clear()

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def backlog_blocks(self) -> int:
        """Blocks of the loads queued or running now."""
        with self._lock:
            return sum(len(j.blocks) for j in self._jobs.values())

    # -- threads ------------------------------------------------------------------------------

    def _lookup_loop(self) -> None:
        # not lowered: a lookup is one short round trip that a waiting request needs (past
        # ``lookup_wait`` it computes its prompt), while a load streams megabytes
        while True:
            item = self._lookups.get()
            if item is None:
                return
            hashes, answered = item
            self.lookups += 1
            try:
                present = self._exists(hashes)
            except Exception:  # the connector logged it and marked the pool down
                present = [None] * len(hashes)
            self.view.mark(hashes, present)
            answered.set()
            with self._lock:
                if self._hinted.get(hashes[0]) is answered:
                    del self._hinted[hashes[0]]
            self._event.set()

    def _load_loop(self) -> None:
        _yield_cpu(self._nice)
        while True:
            job = self._loads.get()
            if job is None:
                return
            if isinstance(job, tuple):  # a probe
                self._run_probe(*job)
                continue
            n = 0
            if job.cancelled:
                self.cancelled += 1
            else:
                t0 = time.perf_counter()
                try:
                    n = self._load(job.blocks, job.block_ids, job.source)
                except Exception:
                    logger.exception("KV load for %s failed; it is recomputed", job.request_id)
                took = time.perf_counter() - t0
                self.load_seconds += took
                self.loads += 1
                if self._on_loaded is not None and job.source is None and n == len(job.blocks):
                    self._on_loaded(n, took, job.tier)  # whole pool loads: the model's samples
                hashes = [b.block_hash for b in job.blocks]
                self.view.mark(hashes[:n], True)
                self.view.mark(hashes[n : n + 1], False)
            with self._lock:
                if self._jobs.get(job.request_id) is job:  # not a newer load of the same id
                    del self._jobs[job.request_id]
                if job.request_id in self._finished:
                    self._later.append((job.request_id, n))
                else:
                    self._finished[job.request_id] = n
            self._event.set()

    def _run_probe(self, hashes: list[bytes], tier: str) -> None:
        t0 = time.perf_counter()
        try:
            n = self._probe(hashes)  # type: ignore[misc]
        except Exception:
            logger.debug("KV probe failed", exc_info=True)
            return
        if n == len(hashes) and self._on_loaded is not None:
            self._on_loaded(n, time.perf_counter() - t0, tier)

    def close(self) -> None:
        self._lookups.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join(30)
