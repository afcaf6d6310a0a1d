"""Fits a worker's step-time cost model to its measured steps (what the conductor plans with).

Each engine step is one sample ``(prefill tokens, decoding sequences, seconds)``; least squares
over the recent ones gives ``seconds ~ base + per_token * prefill_tokens + per_seq * decodes``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from kvpool.protocol.worker import CostModel

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
        """The fitted model; the prior's values where samples are too few or too alike.

        Decode-only steps fix the decode line (base + per sequence); steps with prefill tokens,
        minus their decodes' share, fix the per-token prefill cost."""
        if len(self.samples) < MIN_SAMPLES:
            return self.prior
        data = np.asarray(self.samples, dtype=np.float64)
        p = self.prior
        base, per_seq = p.decode_base_s, p.decode_seq_s
        dec = data[data[:, 0] == 0]
        if len(dec) >= MIN_SAMPLES // 2:
            base, per_seq = _line(dec[:, 1], dec[:, 2], per_seq)
        pre = data[data[:, 0] > 0]
        per_token, pre_base = p.prefill_token_s, base
        if len(pre) >= MIN_SAMPLES // 2:
            y = pre[:, 2] - per_seq * pre[:, 1]
            pre_base, per_token = _line(pre[:, 0], y, per_token)
            if per_token <= 0 or pre_base < 0:
                # prompts of nearly one length on a busy machine: the line is noise and its
                # intercept a wild extrapolation (seconds of "base" that got every request
                # rejected). A step's fixed cost is the decode base; tokens pay the rest.
                pre_base = base
                per_token = max(float(np.mean(y)) - base, 0.0) / float(np.mean(pre[:, 0]))
        return CostModel(
            prefill_base_s=max(pre_base, 1e-4),
            prefill_token_s=max(per_token, 1e-6),
            decode_base_s=max(base, 1e-4),
            decode_seq_s=max(per_seq, 0.0),
        )


def _line(x: np.ndarray, y: np.ndarray, prior_slope: float) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; with one distinct x, the prior slope and the mean."""
    if np.ptp(x) == 0:
        return float(np.mean(y - prior_slope * x)), prior_slope
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


class StepCosts:
    """An engine's predictions for its connector's load-or-recompute decisions, from its own
    measured steps (``samples``); ``steps()`` and ``running()`` read the scheduler."""

    REFIT_STEPS = 32

    def __init__(self, samples: deque[tuple[int, int, float]], steps: Callable[[], int],
                 running: Callable[[], int]) -> None:  # fmt: skip
        self.samples = samples
        self.model = StepModel(samples)
        self.fit, self._fit_step = self.model.fit(), 0
        self._steps, self._running = steps, running

    def prefill_s(self, num_tokens: int) -> float:
        """Predicted seconds to compute ``num_tokens`` more prompt tokens, beyond the decode
        step's fixed cost (paid anyway). From recent steps that prefilled about as many tokens
        (half to twice: a prompt's per-token cost grows with its length; one such step is a
        measurement too), else the fitted line: its per-token slope plus what a step with
        prompt rows costs beyond a decode step (the slope alone put a 32-token prompt at 68 ms
        where it took 80, and a load that would have won was skipped)."""
        self._refit()
        if num_tokens <= 0:
            return 0.0
        fit = self.fit
        alike = [(t - fit.decode_step_s(d)) / p for p, d, t in list(self.samples)[-128:]
                 if num_tokens / 2 <= p <= 2 * num_tokens]  # fmt: skip
        if alike:
            return max(float(np.median(alike)), 0.0) * num_tokens
        extra = max(fit.prefill_base_s - fit.decode_base_s, 0.0)
        return extra + fit.prefill_token_s * num_tokens

    def step_s(self) -> float:
        """Predicted seconds of the step the engine runs now (its running batch decoding; 0
        when nothing runs: then a finished load is picked up at once)."""
        running = self._running()
        if not running:
            return 0.0
        self._refit()
        return self.fit.decode_step_s(running)

    def _refit(self) -> None:
        """Every ``REFIT_STEPS`` steps, and as soon as there are enough samples to replace
        the prior (a new engine's first decisions would otherwise use guesses for 32 steps:
        a decode step 3x what it takes here once decided a short prefix's load)."""
        steps = self._steps()
        on_prior = self.fit is self.model.prior and len(self.samples) >= MIN_SAMPLES
        if on_prior or steps - self._fit_step >= self.REFIT_STEPS:
            self.fit, self._fit_step = self.model.fit(), steps
