"""Fitting the cost model (``cost.py``, compute and memory times added: a CPU does not overlap
them) to measured steps.

Each measured step is a ``StepSample``: the prompt tokens it computed after how much context,
the sequences it decoded over how much KV, and its seconds. The model

    t = base + decode_seq_s * decodes + linear_flops / F + attention_flops / A
        + (weight_bytes + kv_bytes_read) / B

is linear in (1, decodes, linear_flops, attention_flops, kv_bytes_read) once the weights'
read is folded into the intercept, so non-negative least squares (of relative errors) gives ``base + W/B``,
``decode_seq_s``, ``1/F``, ``1/A`` and ``1/B``; the intercept is then split with the weight
bytes the model reads (``weight_bytes``): what it leaves is the step's fixed cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvpool.sim.cost import causal_pairs
from kvpool.sim.profile import ModelSpec

NEGLIGIBLE = 1e-3  # a term the fit drops costs this share of the linear layers' rate


@dataclass(slots=True, frozen=True)
class StepSample:
    prefill_tokens: int = 0  # prompt tokens computed (one prompt's chunk)
    prefill_context: int = 0  # tokens before them (KV read, attention over them)
    decodes: int = 0  # sequences decoding
    decode_context: int = 0  # KV tokens of the decoding sequences, summed
    seconds: float = 0.0
    logits: int = -1  # LM-head rows (-1: one per decode, one if the prompt completes)

    def columns(self, m: ModelSpec) -> list[float]:
        rows = self.logits if self.logits >= 0 else self.decodes + (self.prefill_tokens > 0)
        lin = m.linear_flops_per_token * (self.prefill_tokens + self.decodes) \
            + m.lm_head_flops * rows  # fmt: skip
        pairs = causal_pairs(self.prefill_tokens, self.prefill_context) + self.decode_context
        attn = 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs
        kv = m.kv_bytes_per_token * (self.prefill_context + self.decode_context)
        return [1.0, float(self.decodes), lin, attn, kv]


@dataclass(slots=True, frozen=True)
class StepFit:
    step_base_s: float
    decode_seq_s: float
    linear_flops_per_s: float
    attention_flops_per_s: float
    bytes_per_s: float
    weight_bytes: float  # read per step, as the fit accounts it
    r2: float
    max_rel_error: float
    dropped: tuple[str, ...] = ()  # terms the data gave no positive cost (set negligible)

    def node_fields(self) -> dict:
        """The profile's ``node`` figures for these rates (peak = the faster of the two FLOP
        rates, each an efficiency of it; memory at efficiency 1; no overlap)."""
        peak = max(self.linear_flops_per_s, self.attention_flops_per_s)
        return {"flops_per_s": peak, "mfu": self.linear_flops_per_s / peak,
                "attn_mfu": self.attention_flops_per_s / peak,
                "mem_bytes_per_s": self.bytes_per_s, "mem_efficiency": 1.0, "overlap": False,
                "step_base_s": self.step_base_s, "decode_seq_s": self.decode_seq_s}  # fmt: skip


NAMES = ("base", "decode_seq", "linear", "attention", "kv_bytes")


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop the most negative, refit)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        if keep:
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            coef[keep] = sol
        neg = [i for i in keep if coef[i] < 0]
        if not neg:
            return coef
        keep.remove(min(neg, key=lambda i: coef[i]))


def fit_steps(model: ModelSpec, samples: list[StepSample], weight_bytes: float) -> StepFit:
    """The cost model's figures from measured steps (ValueError if the samples cannot fix
    them: both prefill and decode steps of several sizes are needed)."""
    pre = [s for s in samples if s.prefill_tokens > 0]
    dec = [s for s in samples if s.prefill_tokens == 0 and s.decodes > 0]
    if len({s.prefill_tokens for s in pre}) < 2 or len({s.decodes for s in dec}) < 2:
        raise ValueError("need prefill steps of >= 2 sizes and decode steps of >= 2 batch "
                         "sizes to fit a cost model")  # fmt: skip
    if any(s.seconds <= 0 or not math.isfinite(s.seconds) for s in samples):
        raise ValueError("every sample needs a positive, finite time")
    x = np.array([s.columns(model) for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)  # FLOPs ~1e12, ones ~1
    # relative errors: steps span milliseconds to seconds, and each should be predicted well
    coef = _nnls(x / scale / y[:, None], np.ones_like(y)) / scale
    pred = x @ coef
    ss_res, ss_tot = float(((y - pred) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    dropped = tuple(NAMES[i] for i in (2, 3, 4) if coef[i] <= 0)
    if coef[2] <= 0:
        raise ValueError("the measured steps do not grow with the tokens computed")
    lin_rate = 1.0 / coef[2]
    attn_rate = 1.0 / coef[3] if coef[3] > 0 else lin_rate / NEGLIGIBLE
    bw = 1.0 / coef[4] if coef[4] > 0 else 1e18
    intercept = float(coef[0])
    weights = min(weight_bytes, intercept * bw) if coef[4] > 0 else 1.0
    return StepFit(step_base_s=max(0.0, intercept - weights / bw), decode_seq_s=float(coef[1]),
                   linear_flops_per_s=lin_rate, attention_flops_per_s=attn_rate,
                   bytes_per_s=bw, weight_bytes=max(weights, 1.0),
                   r2=1 - ss_res / ss_tot if ss_tot else 1.0,
                   max_rel_error=float(np.max(np.abs(pred - y) / y)),
                   dropped=dropped)  # fmt: skip
