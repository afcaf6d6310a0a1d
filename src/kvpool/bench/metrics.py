"""Per-request and summary metrics of a replay (names follow ``vllm bench serve`` where they
overlap; TBT as the Mooncake paper defines it: the mean of a request's longest 10 % of gaps)."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict, dataclass, field

DEFAULT_TBT_THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)


@dataclass(slots=True)
class RequestRecord:
    index: int
    arrival_s: float  # scheduled, from the start of the replay
    sent_s: float  # actual send time
    status: str = "error"  # ok | rejected | error
    http_status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0  # as reported by usage (else counted from chunks)
    expected_output: int = 0
    token_times: list[float] = field(default_factory=list)  # seconds from sent_s, per chunk
    end_s: float = 0.0  # from sent_s
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tbt(self) -> float | None:
        return tbt_of(self.gaps)

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    def to_row(self) -> dict:
        row = asdict(self)
        row.pop("token_times")
        row.update(ttft_s=self.ttft, tbt_s=self.tbt, tpot_s=self.tpot, e2e_s=self.end_s,
                   num_chunks=len(self.token_times),
                   token_times_s=" ".join(f"{t:.4f}" for t in self.token_times))  # fmt: skip
        return row


def tbt_of(gaps: list[float]) -> float | None:
    """Mean of the longest 10 % of the gaps (at least one)."""
    if not gaps:
        return None
    top = sorted(gaps, reverse=True)[: max(1, math.ceil(len(gaps) * 0.1))]
    return sum(top) / len(top)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100), None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _stats(prefix: str, values: list[float]) -> dict:
    return {
        f"mean_{prefix}_s": statistics.fmean(values) if values else None,
        f"median_{prefix}_s": percentile(values, 50),
        f"p90_{prefix}_s": percentile(values, 90),
        f"p99_{prefix}_s": percentile(values, 99),
    }


def meets(r: RequestRecord, slo_ttft: float | None, slo_tbt: float | None) -> bool:
    if r.status != "ok" or r.ttft is None:
        return False
    if slo_ttft is not None and r.ttft > slo_ttft:
        return False
    return slo_tbt is None or r.tbt is None or r.tbt <= slo_tbt


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft: float | None,
              slo_tbt: float | None, tbt_thresholds=DEFAULT_TBT_THRESHOLDS) -> dict:  # fmt: skip
    """The run's figures. Effective capacity at a TBT threshold: the share of all requests
    that finished with TTFT within its SLO and TBT within the threshold."""
    ok = [r for r in records if r.status == "ok"]
    n = len(records)
    duration_s = max(duration_s, 1e-9)
    prompt = sum(r.prompt_tokens for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tbt = [r.tbt for r in ok if r.tbt is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [g for r in ok for g in r.gaps]
    good = [r for r in records if meets(r, slo_ttft, slo_tbt)]
    s = {
        "num_requests": n,
        "completed": len(ok),
        "rejected": sum(1 for r in records if r.status == "rejected"),
        "failed": sum(1 for r in records if r.status == "error"),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (prompt + out_tokens) / duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": out_tokens,
        "request_goodput": len(good) / duration_s,
        "goodput_ratio": len(good) / n if n else 0.0,
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "rejection_rate": sum(1 for r in records if r.status == "rejected") / n if n else 0.0,
        "slo_ttft_s": slo_ttft,
        "slo_tbt_s": slo_tbt,
        **_stats("ttft", ttft), **_stats("tpot", tpot), **_stats("itl", itl),
        **_stats("e2e", [r.end_s for r in ok]), **_stats("tbt", tbt),
    }  # fmt: skip
    for th in tbt_thresholds:
        share = sum(1 for r in records if meets(r, slo_ttft, th)) / n if n else 0.0
        s[f"effective_capacity_tbt_{th:g}s"] = share
    return s
