"""The roofline of decode on this machine: what a step must move and compute, what the machine
can move and compute, and what the engine achieves (``kvpool roofline``).

A decode step streams every weight the step's path reads (block weights at small batches, the
float32 ones above ``small_rows``: ``model/weight_formats.py``) plus the KV of every running
request, and does ``2 * weights * batch`` multiply-adds plus attention. Dividing by the
machine's measured read bandwidth and GEMM rate gives two ceilings on tokens per second; the
lower one is the bound that applies. The achieved rate's share of it says how close the engine
comes; a share far below both ceilings means the step is spent on neither (scheduling,
dispatch, synchronization).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvpool.model.autotune import best_time, cpu_name
from kvpool.model.cache import cache_root
from kvpool.model.kv_quant import row_width
from kvpool.model.linear import BlockLinear
from kvpool.model.llama import LlamaModel

logger = logging.getLogger(__name__)

BANDWIDTH_BYTES = 512 << 20  # what the bandwidth probe streams (far beyond any cache)


@dataclass(slots=True)
class MachineLimits:
    """What this machine moves and computes, measured with ``threads`` threads."""

    cpu: str
    threads: int
    read_gbps: float  # streaming a buffer once (what a decode step does with its weights)
    copy_gbps: float  # read + write of a copy
    gemm_gflops: float  # float32 GEMM, large square matrices
    # the block kernel's multiply-adds x 2 per second by batch rows (kernels/qgemm.cpp, a
    # 3072 x 1024 q4 matrix): its rate grows with the rows that share each weight block
    block_gops: dict[int, float] = field(default_factory=dict)

    def block_rate(self, rows: int) -> float:
        """GOP/s of the block kernel at ``rows`` (the nearest measured batch below)."""
        known = sorted(self.block_gops)
        if not known:
            return 0.0
        below = [r for r in known if r <= rows] or known[:1]
        return self.block_gops[below[-1]]


@dataclass(slots=True)
class StepCost:
    weight_bytes: int
    kv_bytes: int
    flops: float
    block_flops: float  # of which through the block kernel

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


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
    bandwidth_share: float  # achieved bytes/s over the read bandwidth

    @property
    def verdict(self) -> str:
        return self.bound if self.share >= 0.5 else "neither (overhead)"


def measure_machine(kernels=None) -> MachineLimits:
    """Read and copy bandwidth, float32 GEMM rate and the block kernel's rate, measured now."""
    n = BANDWIDTH_BYTES // 4
    src, dst = torch.ones(n), torch.empty(n)
    read = best_time(lambda: src.sum(), reps=5)
    copy = best_time(lambda: dst.copy_(src), reps=5)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    gemm = best_time(lambda: torch.mm(a, b))
    block: dict[int, float] = {}
    if kernels is not None:
        from kvpool.model.autotune import ROWS
        from kvpool.model.quant import quantize

        w = quantize(torch.randn(3072, 1024) * 0.02, "q4")  # 1.9 MB: cache-resident
        for rows in ROWS:
            x = torch.randn(rows, 1024)
            t = best_time(lambda x=x: kernels.qlinear(x, w.qs, w.d, w.m))
            block[rows] = 2 * rows * 3072 * 1024 / t / 1e9
    return MachineLimits(cpu_name(), torch.get_num_threads(), BANDWIDTH_BYTES / read / 1e9,
                         2 * BANDWIDTH_BYTES / copy / 1e9, 2 * 1024**3 / gemm / 1e9, block)  # fmt: skip


def machine_limits(kernels=None, fresh: bool = False) -> MachineLimits:
    """``measure_machine``, cached per CPU and thread count in ``<cache>/autotune/``."""
    path = cache_root() / "autotune" / "machine.json"
    key = f"{cpu_name()}|t{torch.get_num_threads()}|{'k' if kernels else '-'}"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not fresh and isinstance(known.get(key), dict):
        try:
            saved = dict(known[key])
            saved["block_gops"] = {int(k): float(v) for k, v in saved["block_gops"].items()}
            return MachineLimits(**saved)
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.info("the cached machine limits are of another version: measuring again")
    limits = measure_machine(kernels)
    known[key] = asdict(limits)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1, sort_keys=True))
    except OSError as exc:
        logger.info("could not cache the machine's limits (%s)", exc)
    return limits


def step_cost(model: LlamaModel, batch: int, context: int) -> StepCost:
    """Bytes and FLOPs of one decode step of ``batch`` sequences of ``context`` tokens."""
    weights = flops = block_flops = 0.0
    for lin in model.linears():
        use_blocks = isinstance(lin, BlockLinear) and batch <= lin.small_rows
        chosen = lin if use_blocks or not isinstance(lin, BlockLinear) else lin.large
        weights += chosen.nbytes
        n_k = _shape(lin)
        flops += 2.0 * batch * n_k
        if use_blocks:
            block_flops += 2.0 * batch * n_k
    c = model.cfg
    elem = torch.empty((), dtype=model.kv_dtype).element_size()
    per_token = c.num_layers * 2 * c.num_kv_heads * row_width(c.head_dim, model.kv_dtype) * elem
    flops += 4.0 * batch * context * c.num_layers * c.num_heads * c.head_dim  # q.k and p.v
    return StepCost(int(weights), batch * context * per_token, flops, block_flops)


def _shape(lin) -> int:
    """N * K of a linear layer."""
    if isinstance(lin, BlockLinear):
        n, k = lin.weights.shape
        return n * k
    return lin.w_t.numel()


def analyze(limits: MachineLimits, cost: StepCost, batch: int, context: int,
            step_s: float) -> RooflineRow:  # fmt: skip
    bw_time = cost.bytes / (limits.read_gbps * 1e9)
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
                       cost.bytes / step_s / 1e9 / limits.read_gbps)  # fmt: skip


def measure_decode(llm, batch: int, context: int, new_tokens: int, seed: int = 0) -> float:
    """Seconds per decode step of ``batch`` streams of ``context`` prompt tokens (median of the
    steps after every stream's first token; greedy, EOS ignored)."""
    from kvpool.engine.sampling import SamplingParams

    prompts = _prompts(llm.engine.model_config.vocab_size, batch, context, seed)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    eng = llm.engine
    eng.reset_prefix_cache()
    before = len(eng.step_times)
    llm.generate(prompts, sp)
    decode = [s for p, d, s in list(eng.step_times)[before:] if p == 0 and d == batch]
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
    ax.plot(b, [r.bandwidth_ceiling_tok_s for r in rows], "--", label=f"bandwidth ceiling "
            f"({limits.read_gbps:.1f} GB/s)")  # fmt: skip
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
