"""Fits a worker's step-time cost model to its measured steps (what the conductor plans with).

Each engine step is one sample ``(prefill tokens, decoding sequences, seconds)``; least squares
over the recent ones gives ``seconds ~ base + per_token * prefill_tokens + per_seq * decodes``.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvpool.conductor.cluster_state import CostModel

MIN_SAMPLES = 8


class StepModel:
    """Recent step samples and the cost model fitted to them."""

    def __init__(
        self, samples: deque[tuple[int, int, float]] | None = None, prior: CostModel | None = None
    ) -> None:
        self.samples = deque(maxlen=512) if samples is None else samples  # e.g. the engine's
        self.prior = prior or CostModel()

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        if seconds > 0:
            self.samples.append((prefill_tokens, decodes, seconds))

    def fit(self) -> CostModel:
        """The fitted model; the prior while samples are too few or too alike to fit."""
        if len(self.samples) < MIN_SAMPLES:
            return self.prior
        data = np.asarray(self.samples, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        p = self.prior
        coef = [p.decode_base_s, p.prefill_token_s, p.decode_seq_s]
        cols = [0] + [i for i in (1, 2) if np.ptp(x[:, i]) > 0]  # constant columns: keep prior
        sol, *_ = np.linalg.lstsq(x[:, cols], y - sum(
            coef[i] * x[:, i] for i in (1, 2) if i not in cols
        ), rcond=None)  # fmt: skip
        for i, v in zip(cols, sol, strict=True):
            coef[i] = float(v)
        base = max(coef[0], 1e-4)
        return CostModel(
            prefill_base_s=base,
            prefill_token_s=max(coef[1], 1e-6),
            decode_base_s=base,
            decode_seq_s=max(coef[2], 0.0),
        )
