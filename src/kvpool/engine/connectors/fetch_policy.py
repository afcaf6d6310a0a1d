"""Fetch only when it pays: load a prefix from the pool only if that beats recomputing it.

A cache is worth the time it saves minus the time its fetch costs, and a hit from a slow tier
can be slower than recomputing. Per request, the scheduler side predicts both:

- **loading** ``n`` blocks: the measured cost of loads from this source (least squares over the
  recent ones: ``seconds ~ latency + bytes / bandwidth``, with the loads queued ahead), plus
  one step of the running batch (a request waits for a step boundary twice: to see its
  lookup's answer and to run after its load: half a step each on average; nothing to wait
  for when nothing else runs);
- **recomputing** them: the engine's own step costs (``StepCosts.prefill_s``: recent prompt
  steps of about that length, else the fitted per-token cost plus a prompt step's extra fixed
  cost over a decode step, which is paid either way: the request computes at least its last
  token).

Both grow linearly with the prefix, so the answer is all or nothing: load the whole available
prefix if that is predicted cheaper, else none of it (short prefixes lose to the fixed costs
of a load; a link slower per byte than compute loses at every length). Predictions within
``CLOSE`` of each other are a tie the figures cannot settle (each side is off by 20-30 % for
short prefixes: a first load that shared the link, a recompute priced from long prompts):
then the option taken less recently for prefixes of about that size is taken, so both sides
get a fresh measurement and the next decision is made on them (an explored option costs at
most ``CLOSE`` times the other's prediction). With no measurement
yet it loads (to measure); when the last measurement is older than ``remeasure_s`` and the
decision is "recompute", ``PROBE_BLOCKS`` of the prefix are read in the background into
scratch memory to measure again, while the request computes (it waits for nothing). ``FetchStats`` counts
the decisions and, for loads, the predicted against the realized seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PROBE_BLOCKS = 4  # blocks a background probe reads
CLOSE = 1.25  # predictions within this factor of each other are a tie (see above)


@dataclass(slots=True)
class FetchStats:
    loads: int = 0  # decisions to load
    recomputes: int = 0  # decisions to recompute a prefix the pool holds
    skipped_lookups: int = 0  # prefixes too short to pay even if the pool held them all
    measuring: int = 0  # of the loads, taken to measure (no measurement yet)
    probes: int = 0  # background reads of a few blocks to refresh stale figures
    predicted_load_seconds: float = 0.0  # over the loads that had a prediction
    realized_load_seconds: float = 0.0  # the same loads, as they went
    saved_compute_seconds: float = 0.0  # predicted recompute time of what was loaded
    ties: int = 0  # decisions between predictions within CLOSE: the less recent option taken


class LoadCostModel:
    """Measured seconds of recent loads against their bytes."""

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.last_sample = -float("inf")

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._samples.append((float(nbytes), seconds))
                self.last_sample = time.monotonic()

    def predict(self, nbytes: int) -> float | None:
        """Seconds to load ``nbytes``; None before any measurement. Never more than the
        fastest load seen of at least as many bytes: below the smallest loads measured, the
        fit's intercept alone decides, and a few noisy samples far from zero can put it
        at several times a small load's real time (fitted to 4-25-block loads, a 2-block
        load was predicted at twice what it took)."""
        with self._lock:
            if not self._samples:
                return None
            data = np.asarray(self._samples)
        x, y = data[:, 0], data[:, 1]
        if len(data) >= 3 and np.ptp(x) > 0.2 * float(np.mean(x)):
            per_byte, latency = np.polyfit(x, y, 1)
            if per_byte > 0 and latency >= 0:
                larger = y[x >= nbytes]
                fit = float(latency + per_byte * nbytes)
                return min(fit, float(larger.min())) if larger.size else fit
        # one size seen (or a fit that makes no sense): proportional to the bytes
        return float(np.sum(y) / np.sum(x) * nbytes)

    def floor(self, nbytes: int) -> float | None:
        """When every load seen was of one size, smaller than ``nbytes``: the least a load of
        ``nbytes`` can take (the fastest of them: their time may be all fixed cost); else
        None. ``predict`` scales them by the bytes, as if none of it were fixed, so one small,
        latency-bound first load would make every larger one look too slow to try, and the
        model would never see a second size."""
        with self._lock:
            if not self._samples:
                return None
            data = np.asarray(self._samples)
        x = data[:, 0]
        one_size = np.ptp(x) <= 0.2 * float(np.mean(x))
        return float(data[:, 1].min()) if one_size and nbytes > 1.2 * float(x.max()) else None


def _size_class(n_blocks: int) -> int:
    """Prefixes within a factor of two of each other share a class (their costs are alike)."""
    return max(n_blocks, 1).bit_length()


TIERS = ("dram", "ssd")  # the pool's tiers, as the master names them (batch_tiers)


class FetchPolicy:
    """Decides, per request, how many of the blocks the pool holds to load."""

    def __init__(self, block_bytes: int, block_size: int, remeasure_s: float = 30.0) -> None:
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.remeasure_s = remeasure_s
        # one load-cost model per pool tier (a block on SSD costs more than one in DRAM);
        # ``loads`` is DRAM's, the fastest, used before a lookup says where blocks are
        self.models = {tier: LoadCostModel() for tier in TIERS}
        self.loads = self.models["dram"]
        self.stats = FetchStats()
        # seconds to compute n prompt tokens, and the engine's typical step (set by the engine)
        self.compute_s: Callable[[int], float] | None = None
        self.step_s: Callable[[], float] | None = None
        self._probed: dict[str, float] = {}  # tier -> when it was last probed
        # (tier, size class) -> {"load"|"compute": when that option was last taken}
        self._taken: dict[tuple[str, int], dict[str, float]] = {}

    def model(self, tier: str = "dram") -> LoadCostModel:
        return self.models.get(tier, self.loads)

    def predicted_load_s(self, n_blocks: int, backlog: int = 0,
                         tier: str = "dram") -> float | None:  # fmt: skip
        """Seconds until ``n_blocks`` (in ``tier``) are loaded and their request runs again,
        behind ``backlog`` blocks of loads queued before it."""
        load = self.model(tier).predict((n_blocks + backlog) * self.block_bytes)
        if load is None:
            return None
        step = self.step_s() if self.step_s is not None else 0.0
        return load + step

    def predicted_compute_s(self, n_blocks: int) -> float | None:
        return None if self.compute_s is None else self.compute_s(n_blocks * self.block_size)

    def worth_looking_up(self, n_blocks: int, backlog: int = 0) -> bool:
        """False if even a hit on all ``n_blocks`` would not pay, by more than a tie (skip
        the lookup too); a stale measurement looks up anyway (a hit can then be probed)."""
        compute = self.predicted_compute_s(n_blocks)
        load = self.predicted_load_s(n_blocks, backlog)
        if load is None or compute is None or self._stale():
            return True
        if load < compute * CLOSE:
            return True  # a lookup, then ``decide``
        self._took("dram", n_blocks, "compute")
        return False

    def decide(self, n_blocks: int, backlog: int = 0,
               tier: str = "dram") -> tuple[int, float | None]:  # fmt: skip
        """(blocks to load, predicted seconds of that load) for ``n_blocks`` the pool holds in
        ``tier`` (the slowest tier among them); counted in ``stats``."""
        if n_blocks <= 0:
            return 0, None
        compute = self.predicted_compute_s(n_blocks)
        load = self.predicted_load_s(n_blocks, backlog, tier)
        if load is None or compute is None:  # nothing to compare yet: load, and measure
            self.stats.measuring += 1
            return self._load(tier, n_blocks, load, 0.0)
        if max(load, compute) <= CLOSE * min(load, compute):  # a tie: the less recent one
            self.stats.ties += 1
            taken = self._taken.get((tier, _size_class(n_blocks)), {})
            if taken.get("load", -float("inf")) <= taken.get("compute", -float("inf")):
                return self._load(tier, n_blocks, load, compute)
            return self._recompute(tier, n_blocks)
        if load < compute:
            return self._load(tier, n_blocks, load, compute)
        floor = self.model(tier).floor((n_blocks + backlog) * self.block_bytes)
        step = self.step_s() if self.step_s is not None else 0.0
        if floor is not None and floor + step < compute:  # it may pay: measure it
            self.stats.measuring += 1
            return self._load(tier, n_blocks, None, 0.0)
        return self._recompute(tier, n_blocks)

    def _load(self, tier: str, n_blocks: int, load: float | None,
              compute: float) -> tuple[int, float | None]:  # fmt: skip
        self.stats.loads += 1
        self.stats.saved_compute_seconds += compute
        self._took(tier, n_blocks, "load")
        return n_blocks, load

    def _recompute(self, tier: str, n_blocks: int) -> tuple[int, None]:
        self.stats.recomputes += 1
        self._took(tier, n_blocks, "compute")
        return 0, None

    def _took(self, tier: str, n_blocks: int, option: str) -> None:
        self._taken.setdefault((tier, _size_class(n_blocks)), {})[option] = time.monotonic()

    def wants_probe(self, tier: str = "dram") -> bool:
        """True (once per ``remeasure_s`` per tier) when ``tier``'s load figures are stale: the
        caller reads a few blocks in the background, into scratch memory, to refresh them
        (nobody waits)."""
        now = time.monotonic()
        if not self._stale(tier) or now - self._probed.get(tier, -float("inf")) < self.remeasure_s:
            return False
        self._probed[tier] = now
        self.stats.probes += 1
        return True

    def _stale(self, tier: str = "dram") -> bool:
        return time.monotonic() - self.model(tier).last_sample > self.remeasure_s

    def observe_load(self, n_blocks: int, seconds: float, tier: str = "dram") -> None:
        """The load thread moved ``n_blocks`` from ``tier`` in ``seconds`` (feeds that tier's
        cost model)."""
        self.model(tier).observe(n_blocks * self.block_bytes, seconds)

    def observe_wait(self, seconds: float, predicted: float | None) -> None:
        """A request waited ``seconds`` for its load, from the decision to being runnable
        again (``predicted``: what ``decide`` said)."""
        if predicted is not None:
            self.stats.predicted_load_seconds += predicted
            self.stats.realized_load_seconds += seconds
