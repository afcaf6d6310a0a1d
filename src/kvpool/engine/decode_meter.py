"""The roofline of the engine's own decode steps, as it runs (``/metrics``: ``kvpool roofline``'s
figures for the live workload).

After each step made only of decodes, ``observe(batch, context_tokens, seconds)``: the bytes
the step moved (the weights its path read for that batch, ``model/step_cost.py``, plus the KV
of every sequence), the bandwidth that makes (a moving average over recent steps), and, when
this machine's limits were measured (``kvpool roofline`` caches them; a server never measures
on its own), that bandwidth's share of the machine's (at the step's bytes: a working set that
fits in the caches reads faster than memory) and the bandwidth ceiling on tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.model.machine import MachineLimits
from kvpool.model.step_cost import kv_bytes_per_token, step_cost

ALPHA = 0.2  # weight of the newest step in the moving averages


@dataclass(slots=True, frozen=True)
class DecodeFigures:
    batch: int
    weight_bytes: int  # of the last decode step
    kv_bytes: int
    bytes_per_s: float  # achieved, moving average
    tokens_per_s: float  # moving average
    limit_bytes_per_s: float | None  # the machine's read bandwidth at the step's bytes, if known
    share: float | None  # bytes_per_s over it
    ceiling_tokens_per_s: float | None  # the last step's batch over its bytes at that limit


class DecodeMeter:
    def __init__(self, model, limits: MachineLimits | None) -> None:
        self.model = model
        self.limits = limits
        self.per_token = kv_bytes_per_token(model)
        self._weights: dict[int, int] = {}  # batch -> weight bytes its path reads
        self._bps = self._tps = 0.0
        self.figures: DecodeFigures | None = None
        self.steps = 0

    def weight_bytes(self, batch: int) -> int:
        if batch not in self._weights:
            self._weights[batch] = step_cost(self.model, batch, 0).weight_bytes
        return self._weights[batch]

    def observe(self, batch: int, context_tokens: int, seconds: float) -> None:
        if batch < 1 or seconds <= 0:
            return
        wb, kv = self.weight_bytes(batch), context_tokens * self.per_token
        bps, tps = (wb + kv) / seconds, batch / seconds
        first = self.steps == 0
        self._bps = bps if first else ALPHA * bps + (1 - ALPHA) * self._bps
        self._tps = tps if first else ALPHA * tps + (1 - ALPHA) * self._tps
        self.steps += 1
        # the machine's read bandwidth at this step's bytes (cache-resident where they fit)
        limit = self.limits.read_ceiling(wb + kv) * 1e9 if self.limits is not None else None
        self.figures = DecodeFigures(
            batch, wb, kv, self._bps, self._tps, limit,
            self._bps / limit if limit else None,
            batch * limit / (wb + kv) if limit else None,
        )  # fmt: skip
