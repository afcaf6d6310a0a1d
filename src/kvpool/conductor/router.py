"""Routing and SLO-aware early rejection: a policy's placements, checked against the SLOs.

``Router.route`` is a pure function of a snapshot and a request (plus the policy's own state):
it picks a prefill worker and a decode worker (or one colocated worker), and rejects the
request up front, with a reason, when the predicted TTFT or TBT would break its SLO, or when
too many requests are already in flight. Decode load is predicted for the moment the request
would reach decode (after its predicted TTFT), not only for now.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.errors import RejectedError, UnavailableError
from kvpool.conductor.cluster_state import ClusterSnapshot, Placement, RequestInfo, WorkerView
from kvpool.conductor.policies import Policy, predicted_tbt, predicted_ttft

REJECT_REASONS = ("ttft_slo", "tbt_slo", "queue_full", "no_worker")


@dataclass(slots=True)
class SLOConfig:
    """Service-level objectives (None: not enforced) and the in-flight bound."""

    ttft_s: float | None = 30.0
    tbt_s: float | None = 2.0
    max_inflight: int = 64  # requests in flight through the conductor

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tbt_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0 (or None)")
        if self.max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")


@dataclass(slots=True, frozen=True)
class Route:
    """Where a request goes: ``prefill`` is None when one worker does both (``decode``)."""

    prefill: Placement | None
    decode: Placement
    predicted_ttft_s: float
    predicted_tbt_s: float


class Router:
    """``decode_prefill_tokens``: when the decode worker would have at most this many prompt
    tokens left to compute after loading what its cache and the pool hold (a new chat turn on
    a known conversation, say), and its predicted TTFT is no later than the prefill worker's,
    it computes them itself and the prefill hand-off is skipped: one hop less, a short chunk
    more in the decode batch (0: always hand off). That prompt step is a gap in every stream
    the decode worker is stepping, and keeping prompt work out of decode steps is what
    disaggregation is for: so a decode worker with running streams keeps a remainder only
    when handing it off would break the TTFT SLO and keeping it would not. (A hand-off costs
    the decode side one token: the prefill's KV handle carries the prompt's partial last
    block. Measured: always handing off under load halved the disaggregated TBT p99 of
    ``bench_serving.py`` against keeping remainders whenever their TTFT gained.)"""

    def __init__(self, policy: Policy, slo: SLOConfig | None = None,
                 decode_prefill_tokens: int = 0) -> None:  # fmt: skip
        if decode_prefill_tokens < 0:
            raise ValueError("decode_prefill_tokens must be >= 0")
        self.policy = policy
        self.slo = slo or SLOConfig()
        self.decode_prefill_tokens = decode_prefill_tokens

    def route(self, snap: ClusterSnapshot, req: RequestInfo, inflight: int) -> Route:
        """The route of ``req``; RejectedError (429) or UnavailableError (no worker at all)."""
        if inflight >= self.slo.max_inflight:
            raise _reject("queue_full", f"{inflight} requests in flight", 1.0)
        pre = self.policy.choose_prefill(snap, req)
        if snap.alive(lambda w: w.role == "decode"):
            dec = self.policy.choose_decode(snap, req, pre.predicted_s if pre else 0.0)
            assert dec is not None
            at_decode = predicted_ttft(snap, self._view(snap, dec.worker_id), req)
            left = req.num_prompt_tokens - (at_decode.local_blocks + at_decode.pool_blocks) * \
                req.block_size  # fmt: skip
            if pre is not None and left <= self.decode_prefill_tokens:
                idle = not self._view(snap, dec.worker_id).load.running
                slo = self.slo.ttft_s
                rescued = slo is not None and at_decode.predicted_s <= slo < pre.predicted_s
                if (idle and at_decode.predicted_s <= pre.predicted_s) or rescued:
                    pre = None  # a short remainder, computed where it waits for nobody
            # no prefill worker (left, or needed): the decode worker computes the prompt
            ttft = at_decode.predicted_s if pre is None else pre.predicted_s
        elif pre is not None:  # colocated workers (or every decode worker is gone)
            dec = Placement(pre.worker_id,
                            predicted_tbt(self._view(snap, pre.worker_id), pre.predicted_s))  # fmt: skip
            ttft, pre = pre.predicted_s, None
        else:
            raise UnavailableError("no live worker can serve this request")
        self._check(ttft, dec.predicted_s)
        return Route(pre, dec, ttft, dec.predicted_s)

    @staticmethod
    def _view(snap: ClusterSnapshot, worker_id: str) -> WorkerView:
        return next(w for w in snap.workers if w.id == worker_id)

    def _check(self, ttft: float, tbt: float) -> None:
        slo = self.slo
        if slo.ttft_s is not None and ttft > slo.ttft_s:
            raise _reject("ttft_slo", f"predicted TTFT {ttft:.2f}s > SLO {slo.ttft_s}s",
                          ttft - slo.ttft_s)  # fmt: skip
        if slo.tbt_s is not None and tbt > slo.tbt_s:
            raise _reject("tbt_slo", f"predicted TBT {tbt:.3f}s > SLO {slo.tbt_s}s", 1.0)


def _reject(reason: str, why: str, retry_after: float) -> RejectedError:
    return RejectedError(f"request rejected by admission control: {why}",
                         retry_after=max(1.0, retry_after), reason=reason)  # fmt: skip
