"""A finished simulation as the bench report's records and summary, plus what only a
simulator can tell: each request's predicted and realized prefix hit and why they differ,
each node's load, the queues over time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

from kvpool.bench.metrics import RequestRecord, summarize, tbt_of
from kvpool.sim.cluster import SimCluster
from kvpool.sim.job import OUTCOMES, outcome

# realized TTFT this much above the prediction: the conductor's view of the load was off
TTFT_SLACK = 0.5


@dataclass(slots=True)
class SimRecord(RequestRecord):
    """A replay's request record (``bench.metrics``) with the route and its predictions."""

    prefill_node: str = ""
    decode_node: str = ""
    predicted_hit_tokens: int = 0
    realized_hit_tokens: int = 0
    best_hit_tokens: int = 0  # the longest prefix any worker or the pool held at routing
    predicted_ttft_s: float | None = None
    route_outcome: str = ""
    # the gaps and TBT, computed once: a summary and its plots ask for them many times
    memo: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def _memo(self) -> tuple:
        if self.memo is None:
            gaps = RequestRecord.gaps.fget(self)  # type: ignore[attr-defined]
            self.memo = (gaps, tbt_of(gaps))
        return self.memo

    @property
    def gaps(self) -> list[float]:
        return self._memo()[0]

    @property
    def tbt(self) -> float | None:
        return self._memo()[1]

    def to_row(self) -> dict:
        """``RequestRecord.to_row``'s columns, without its ``asdict`` (a deep copy of every
        token time: most of a large report's writing time)."""
        row = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("token_times", "memo")}  # fmt: skip
        row.update(ttft_s=self.ttft, tbt_s=self.tbt, tpot_s=self.tpot, e2e_s=self.end_s,
                   num_chunks=len(self.token_times),
                   token_times_s=" ".join(f"{t:.4f}" for t in self.token_times))  # fmt: skip
        return row


def _record(c: SimCluster, i: int) -> SimRecord:
    req = c.requests[i]
    rec = SimRecord(req.index, req.arrival_s, req.arrival_s, prompt_tokens=req.input_tokens,
                    expected_output=req.output_tokens)  # fmt: skip
    if i in c.rejected:
        rec.status, rec.http_status, rec.error = "rejected", 429, c.rejected[i]
        return rec
    job = c.jobs[i]
    assert job is not None
    if job.finish < 0:  # cannot happen when the loop ran dry; kept honest if it did not
        rec.error = "not finished"
        return rec
    bt, t0 = c.block_tokens, req.arrival_s
    rec.status, rec.http_status = "ok", 200
    rec.cached_tokens = rec.realized_hit_tokens = min(job.reused * bt, req.input_tokens)
    rec.predicted_hit_tokens = min(job.predicted_blocks * bt, req.input_tokens)
    rec.best_hit_tokens = min(job.best_blocks * bt, req.input_tokens)
    rec.predicted_ttft_s = job.predicted_ttft_s
    rec.output_tokens = req.output_tokens
    times = [job.first_s - t0]
    if job.tail_s >= 0:
        times.append(job.tail_s - t0)
    if job.decode_tokens > 0:
        ends = c.by_id[job.decode_on].decode_ends
        times.extend(t - t0 for t in ends[job.join : job.join + job.decode_tokens])
    rec.token_times = times
    rec.end_s = job.finish - t0
    rec.prefill_node, rec.decode_node = job.computed_on, job.decode_on
    rec.route_outcome = outcome(job)
    return rec


def records(c: SimCluster) -> list[SimRecord]:
    return [_record(c, i) for i in range(len(c.requests))]


def routing_figures(c: SimCluster, recs: list[SimRecord]) -> dict:
    """How right the conductor's predictions were, and why not."""
    ok = [r for r in recs if r.status == "ok"]
    prompt = sum(r.prompt_tokens for r in ok) or 1
    counts = Counter(r.route_outcome for r in ok)
    left = [r for r in ok if r.realized_hit_tokens < r.best_hit_tokens]
    left_tokens = sum(r.best_hit_tokens - r.realized_hit_tokens for r in left)
    slow = [r for r in ok if r.ttft is not None and r.predicted_ttft_s is not None
            and r.ttft > r.predicted_ttft_s * (1 + TTFT_SLACK) and r.ttft - r.predicted_ttft_s > 0.01]  # fmt: skip
    out = {
        "sim_predicted_hit_rate": sum(r.predicted_hit_tokens for r in ok) / prompt,
        "sim_best_hit_rate": sum(r.best_hit_tokens for r in ok) / prompt,
        **{f"sim_route_{k}": counts.get(k, 0) for k in OUTCOMES},
        # the route took a shorter prefix than some worker held: load balancing (or chance)
        "sim_route_cache_left_elsewhere": len(left),
        "sim_route_cache_left_tokens": left_tokens,
        # TTFT more than TTFT_SLACK above the router's prediction: its load view was off
        "sim_route_ttft_over_prediction": len(slow),
    }
    for reason, n in sorted(Counter(c.rejected.values()).items()):
        out[f"sim_rejected_{reason}"] = n
    return out


def node_figures(c: SimCluster, duration: float) -> list[dict]:
    return [{"id": n.id, "role": n.role, "requests": n.requests, "steps": n.steps,
             "busy_s": n.busy_s, "utilization": n.busy_s / duration if duration else 0.0,
             "prefilled_tokens": n.prefilled_tokens, "decoded_tokens": n.decoded_tokens,
             "cached_blocks": len(n.cache), "cache_evictions": n.cache.evictions}
            for n in c.nodes]  # fmt: skip


def summary_of(c: SimCluster, recs: list[SimRecord]) -> tuple[dict, dict]:
    """(the bench summary with the simulator's figures added, the simulator's details)."""
    cfg = c.cfg
    t0 = c.requests[0].arrival_s if c.requests else 0.0
    done = [j.finish for j in c.jobs if j is not None and j.finish >= 0]
    duration = max([*done, *(r.arrival_s for r in c.requests)], default=0.0) - t0
    s = summarize(recs, duration, cfg.slo_ttft, cfg.slo_tbt)
    s.update(routing_figures(c, recs))
    s["sim_transfers"] = c.transfers
    s["sim_transfer_bytes"] = c.transfer_bytes
    s["sim_local_cache_evictions"] = sum(n.cache.evictions for n in c.nodes)
    if c.pool is not None:
        s.update({f"sim_{k}": v for k, v in c.pool.stats().items()})
    s["sim_events"] = c.loop.events
    details = {
        "system": {"shape": c.system.shape, "policy": getattr(c.router.policy, "name", "?"),
                   "pool": c.pool is not None, "chunked": c.system.chunked},
        "worker_cost_model": c.worker_cost.to_dict(),
        "nodes": node_figures(c, duration),
        "timeline": {
            "t": [t for t, _, _, _ in c.timeline],
            "queued_prefill_tokens": [q for _, q, _, _ in c.timeline],
            "decode_batch": [b for _, _, b, _ in c.timeline],
            "pool_used_blocks": [u for _, _, _, u in c.timeline],
            "node_ids": [n.id for n in c.nodes],
        },
    }  # fmt: skip
    return s, details
