"""The simulator's requests: a trace scaled exactly as ``kvpool bench replay`` scales it
(``bench.trace.scale``: the same arrivals, lengths and blocks), without making token ids.

A simulated block is one scaled trace block (``ScaleConfig.block_tokens`` tokens); its hash
is derived from the trace's block id, which already names the whole prefix up to it, so equal
ids are equal chains (as the real chained hash makes equal token prefixes). Only the full
blocks before a prompt's last token are hashed, as the conductor does (``api.request_info``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.bench.trace import ScaleConfig, TraceRequest, scaled_arrivals


@dataclass(slots=True, frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hashes: tuple[bytes, ...]  # of the full blocks before the last prompt token


class BlockNames:
    """One bytes object per trace block id (shared by every request that names it)."""

    def __init__(self) -> None:
        self._names: dict[int, bytes] = {}

    def __call__(self, block_id: int) -> bytes:
        h = self._names.get(block_id)
        if h is None:
            h = self._names[block_id] = block_id.to_bytes(8, "little", signed=True)
        return h


def usable_blocks(input_tokens: int, block_tokens: int) -> int:
    """Full blocks that end before the prompt's last token (the last one is always computed)."""
    return (input_tokens - 1) // block_tokens


def scale_requests(requests: list[TraceRequest], cfg: ScaleConfig) -> list[SimRequest]:
    """``bench.trace.scale`` without token ids: arrival (s), lengths and block hashes."""
    names = BlockNames()
    out: list[SimRequest] = []
    for i, r, arrival, n_in, n_out in scaled_arrivals(requests, cfg):
        full = r.hash_ids[: usable_blocks(n_in, cfg.block_tokens)]
        out.append(SimRequest(i, arrival, n_in, n_out, tuple(names(h) for h in full)))
    return out


def workload_facts(requests: list[SimRequest], block_tokens: int) -> dict:
    """Span, rate, mean lengths and the offline (unbounded cache) prefix hit ratio."""
    if not requests:
        return {"requests": 0}
    seen: set[bytes] = set()
    hit = 0
    for r in requests:
        hit += sum(1 for h in r.hashes if h in seen) * block_tokens
        seen.update(r.hashes)
    n = len(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    prompt = sum(r.input_tokens for r in requests)
    return {
        "requests": n,
        "span_s": span,
        "rate_per_s": (n - 1) / span if span > 0 else None,
        "mean_input_tokens": prompt / n,
        "mean_output_tokens": sum(r.output_tokens for r in requests) / n,
        "distinct_blocks": len(seen),
        "offline_prefix_hit_ratio": hit / prompt if prompt else 0.0,
    }
