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
# why a decode worker computes a prompt itself: a short remainder, a prompt lent to it by a
# prefill queue far behind, no prefill worker alive
ON_DECODE = ("remainder", "lent", "no_prefill")
# a prompt is lent only while the prefill worker's queue has been non-empty this share of the
# last seconds (``WorkerLoad.backlogged``): sustained load, where the decode worker's idle time
# is throughput; after a burst, the gaps lent prompts make in its streams cost more than the
# TTFT they save (measured: bench_serving.py's TBT p99)
LEND_BACKLOG = 0.8


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
    """Where a request goes: ``prefill`` is None when one worker does both (``decode``);
    ``decode_prompt_tokens``: the prompt tokens ``decode`` computes itself (then), and why a
    decode worker does (``ON_DECODE``; "" for a colocated worker or a hand-off)."""

    prefill: Placement | None
    decode: Placement
    predicted_ttft_s: float
    predicted_tbt_s: float
    decode_prompt_tokens: int = 0
    on_decode: str = ""


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
    ``bench_serving.py`` against keeping remainders whenever their TTFT gained.)

    ``decode_prefill_gain``: a decode worker computes a whole prompt itself, however long,
    when the prefill workers are so far behind that doing so divides the request's predicted
    TTFT by at least this factor, the TTFT it saves exceeds half the delay its prompt steps add
    to the streams the decode worker is running (each waits that long once; half, because the
    requests arriving after it find the prefill queue that much shorter), and those steps stay
    within the TBT SLO (0: never); and only under sustained load (``LEND_BACKLOG``). Under
    prompt-heavy load a prefill worker's queue grows while its decode worker idles between
    short steps; this lends the idle time to the queue. Both workers idle or nearly, or a
    burst: the hand-off stands."""

    def __init__(self, policy: Policy, slo: SLOConfig | None = None,
                 decode_prefill_tokens: int = 0, decode_prefill_gain: float = 0.0) -> None:  # fmt: skip
        if decode_prefill_tokens < 0:
            raise ValueError("decode_prefill_tokens must be >= 0")
        if decode_prefill_gain != 0 and not decode_prefill_gain >= 1:
            raise ValueError("decode_prefill_gain must be 0 (off) or >= 1")
        self.policy = policy
        self.slo = slo or SLOConfig()
        self.decode_prefill_tokens = decode_prefill_tokens
        self.decode_prefill_gain = decode_prefill_gain

    def route(self, snap: ClusterSnapshot, req: RequestInfo, inflight: int) -> Route:
        """The route of ``req``; RejectedError (429) or UnavailableError (no worker at all)."""
        if inflight >= self.slo.max_inflight:
            raise _reject("queue_full", f"{inflight} requests in flight", 1.0)
        pre = self.policy.choose_prefill(snap, req)
        why = ""
        if snap.alive(lambda w: w.role == "decode"):
            dec = self.policy.choose_decode(snap, req, pre.predicted_s if pre else 0.0)
            assert dec is not None
            view = self._view(snap, dec.worker_id)
            at_decode = predicted_ttft(snap, view, req)
            left = req.num_prompt_tokens - (at_decode.local_blocks + at_decode.pool_blocks) * \
                req.block_size  # fmt: skip
            if pre is None:
                why = "no_prefill"
            elif left <= self.decode_prefill_tokens:
                idle = not view.load.running
                slo = self.slo.ttft_s
                rescued = slo is not None and at_decode.predicted_s <= slo < pre.predicted_s
                if (idle and at_decode.predicted_s <= pre.predicted_s) or rescued:
                    pre, why = None, "remainder"  # computed where it waits for nobody
            if pre is not None and self._lend(self._view(snap, pre.worker_id), view,
                                              at_decode.predicted_s, pre.predicted_s, left):  # fmt: skip
                pre, why = None, "lent"  # the prefill queue is long and the decode worker has time
            ttft = at_decode.predicted_s if pre is None else pre.predicted_s
            own = max(1, left) if pre is None else 0
        elif pre is not None:  # colocated workers (or every decode worker is gone)
            dec = Placement(pre.worker_id,
                            predicted_tbt(self._view(snap, pre.worker_id), pre.predicted_s))  # fmt: skip
            own = max(1, req.num_prompt_tokens - (pre.local_blocks + pre.pool_blocks) *
                      req.block_size)  # fmt: skip
            ttft, pre = pre.predicted_s, None
        else:
            raise UnavailableError("no live worker can serve this request")
        self._check(ttft, dec.predicted_s)
        return Route(pre, dec, ttft, dec.predicted_s, own, why)

    def _lend(self, pre: WorkerView, dec: WorkerView, at_decode_s: float, at_prefill_s: float,
              left: int) -> bool:  # fmt: skip
        """Whether decode worker ``dec`` computes a whole prompt of ``left`` uncached tokens
        itself (``decode_prefill_gain``): TTFT ``at_decode_s`` there against ``at_prefill_s``
        on prefill worker ``pre``, whose queue must have been full for a while (not a burst)."""
        gain = self.decode_prefill_gain
        if not gain or at_decode_s * gain > at_prefill_s or pre.load.backlogged < LEND_BACKLOG:
            return False
        prompt_s, running = dec.cost.prefill_s(left), dec.load.running
        if running and self.slo.tbt_s is not None:  # its longest step: one chunk and the decodes
            chunk = min(left, max(1, dec.step_tokens - running)) if dec.step_tokens else left
            if dec.cost.prefill_s(chunk) + dec.cost.decode_step_s(running) > self.slo.tbt_s:
                return False
        # half the delay: the prompt also leaves the prefill queue, so the requests that
        # arrive after it wait that much less there
        return at_prefill_s - at_decode_s > 0.5 * running * prompt_s

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
