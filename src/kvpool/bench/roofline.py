"""The roofline of decode on this machine: what a step must move and compute, what the machine
can move and compute, and what the engine achieves (``kvpool roofline``).

A decode step streams every weight the step's path reads (block weights at small batches, the
float32 ones above ``small_rows``: ``model/weight_formats.py``) plus the KV of every running
request, and does ``2 * weights * batch`` multiply-adds plus attention. Dividing by the
machine's measured read bandwidth and GEMM rate gives two ceilings on tokens per second (the
bandwidth at the step's own bytes, read again and again: on a CPU whose last-level cache holds
the model, steps read it from there, faster than from memory); the
lower one is the bound that applies. The achieved rate's share of it says how close the engine
comes; a share far below both ceilings means the step is spent on neither (scheduling,
dispatch, synchronization).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpool.model.machine import MachineLimits, machine_limits, measure_machine
from kvpool.model.step_cost import StepCost, step_cost

__all__ = ["MachineLimits", "RooflineRow", "StepCost", "analyze", "kv_sources",
           "machine_limits", "measure_decode", "measure_machine", "plot", "step_cost"]  # fmt: skip

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RooflineRow:
    batch: int
    context: int
    step_s: float  # measured decode step
    weight_mb: float
    kv_mb: float
    achieved_gbps: float
    tok_s: float
    bandwidth_ceiling_tok_s: float
    compute_ceiling_tok_s: float
    bound: str  # "bandwidth" | "compute"
    share: float  # achieved tokens/s over the binding ceiling
    bandwidth_share: float  # achieved bytes/s over the read bandwidth at the step's bytes
    read_gbps: float  # that bandwidth: the bandwidth ceiling's
    memory_share: float  # achieved bytes/s over the read bandwidth from memory (the far probe)

    @property
    def verdict(self) -> str:
        return self.bound if self.share >= 0.5 else "neither (overhead)"


def analyze(limits: MachineLimits, cost: StepCost, batch: int, context: int,
            step_s: float, read_gbps: float | None = None) -> RooflineRow:  # fmt: skip
    """The step's row: ``read_gbps`` is the machine's read bandwidth over a working set of the
    step's bytes (measured beside it), else ``limits.read_ceiling`` of them; never below the
    bandwidth from memory."""
    bw = max(limits.read_gbps, read_gbps or limits.read_ceiling(cost.bytes))
    bw_time = cost.bytes / (bw * 1e9)
    dense_flops = cost.flops - cost.block_flops
    compute_time = dense_flops / (limits.gemm_gflops * 1e9)
    if cost.block_flops:
        compute_time += cost.block_flops / (max(limits.block_rate(batch), 1e-9) * 1e9)
    bw_ceiling, compute_ceiling = batch / bw_time, batch / compute_time
    bound = "bandwidth" if bw_ceiling <= compute_ceiling else "compute"
    tok_s = batch / step_s
    return RooflineRow(batch, context, step_s, cost.weight_bytes / 1e6, cost.kv_bytes / 1e6,
                       cost.bytes / step_s / 1e9, tok_s, bw_ceiling, compute_ceiling, bound,
                       tok_s / min(bw_ceiling, compute_ceiling),
                       cost.bytes / step_s / 1e9 / bw, bw,
                       cost.bytes / step_s / 1e9 / limits.read_gbps)  # fmt: skip


def measure_decode(llm, batch: int, context: int, new_tokens: int, seed: int = 0) -> float:
    """Seconds per decode step of ``batch`` streams of ``context`` prompt tokens (median of the
    steps after every stream's first token; greedy, EOS ignored)."""
    from kvpool.engine.sampling import SamplingParams

    prompts = _prompts(llm.engine.model_config.vocab_size, batch, context, seed)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    eng = llm.engine
    eng.reset_prefix_cache()
    before = eng.steps_recorded
    llm.generate(prompts, sp)
    # this call's steps: the last ones of the record (a bounded deque: its length stops
    # growing once full, so count what was appended instead)
    ran = min(eng.steps_recorded - before, len(eng.step_times))
    recent = list(eng.step_times)[-ran:] if ran else []
    decode = [s for p, d, s in recent if p == 0 and d == batch]
    if not decode:
        raise RuntimeError("no full decode step was measured (batch larger than max_num_seqs?)")
    decode.sort()
    return decode[len(decode) // 2]


def plot(rows: list[RooflineRow], limits: MachineLimits, title: str, path: Path) -> None:
    """Achieved tokens/s against both ceilings across batch sizes (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = [r.batch for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lo, hi = min(r.read_gbps for r in rows), max(r.read_gbps for r in rows)
    ax.plot(b, [r.bandwidth_ceiling_tok_s for r in rows], "--", label=f"bandwidth ceiling "
            f"(at each step's bytes: {lo:.1f}-{hi:.1f} GB/s; memory {limits.read_gbps:.1f})")  # fmt: skip
    ax.plot(b, [r.compute_ceiling_tok_s for r in rows], ":", label="compute ceiling")
    ax.plot(b, [r.tok_s for r in rows], "o-", label="achieved")
    for r in rows:
        ax.annotate(f"{r.share:.2f}", (r.batch, r.tok_s), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="decode batch (sequences)",
           ylabel="tokens/s", title=title)  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _prompts(vocab: int, batch: int, context: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 40000), (batch, context), generator=g).tolist()


def kv_sources(llm, connector, batch: int, context: int, new_tokens: int, seed: int = 0) -> dict:
    """Run ``measure_decode``'s prompts again after the engine's cache is emptied (their blocks
    are in the pool by then): how many prompt tokens were computed, came from the engine's
    cache or from the pool, and the loads' seconds and bandwidth."""
    from kvpool.common.hashing import block_hashes
    from kvpool.engine.sampling import SamplingParams

    eng = llm.engine
    prompts = _prompts(eng.model_config.vocab_size, batch, context, seed)
    hashes = [h for p in prompts for h in block_hashes(p, eng.block_size, eng.kv_manager.hash_seed)]
    saved = connector.wait_saved(hashes, 60.0)
    eng.step()  # an empty step gives back the blocks held for the saves that completed...
    eng.reset_prefix_cache()  # ...so their hashes go too: the prompts can only hit the pool
    before, stats = eng.stats(), connector.stats
    loaded, load_s = stats.loaded_bytes, stats.load_seconds
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    after = eng.stats()
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    pool = after.external_prefix_hits - before.external_prefix_hits
    local = after.prefix_cache_hits - before.prefix_cache_hits - pool
    nbytes, seconds = stats.loaded_bytes - loaded, stats.load_seconds - load_s
    return {"batch": batch, "prompt_tokens": batch * context, "queried_tokens": queried,
            "engine_tokens": local, "pool_tokens": pool,
            "computed_tokens": batch * context - local - pool, "pool_load_s": seconds,
            "pool_load_bytes": nbytes, "saved_before": saved,
            "saved_blocks": stats.saved_blocks, "dropped_saves": stats.dropped_saves,
            "pool_errors": stats.pool_errors,
            "pool_load_gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0}  # fmt: skip
