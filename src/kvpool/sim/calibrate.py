"""``kvpool sim calibrate``: measure this machine's engine and link into a profile.

It runs the real kvpool engine (the default SmolLM2, or ``--model``) with the thread count
``kvpool serve`` gives each of its two workers here: prefill steps of several prompt sizes,
with and without a cached prefix, and decode steps of several batch sizes and contexts, each
timed around ``LLMEngine.step`` (the whole step a worker runs: scheduling, the forward pass,
sampling). ``fit.fit_steps`` turns them into the cost model's figures. The link is the
transfer engine's shared-memory path (what a decode worker's block reads and pool loads use
on one host): batches of block-sized READs, fitted to ``overhead + bytes / bandwidth``. The
serving limits are those of ``kvpool serve``'s defaults (1 GiB of KV per worker, a 1 GiB pool
node, 64 sequences, 2048 tokens per step). About a minute on two cores.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpool.config import ClusterConfig, parse_size
from kvpool.sim.fit import StepSample, fit_steps
from kvpool.sim.profile import ModelSpec, NetworkSpec, NodeSpec, PoolSpec, Profile


@dataclass(slots=True)
class CalibrationConfig:
    model: str | None = None  # default: SmolLM2-135M-Instruct
    threads: int | None = None  # default: kvpool serve's share for one of two workers
    name: str = "local-smollm2"
    quick: bool = False  # fewer sizes and repeats
    kv_cache_memory: int | str = "1GiB"  # per worker, as kvpool serve
    pool_node_bytes: int | str = "1GiB"  # kvpool serve's pool node

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.pool_node_bytes = parse_size(self.pool_node_bytes)

    @property
    def workers_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 2) // 2)


class _Driver:
    """Runs requests through an engine one step at a time and times the steps. Prefixes are
    made once per length and stay in the engine's prefix cache (computing them is most of a
    CPU calibration's time otherwise)."""

    def __init__(self, llm, seed: int = 0) -> None:
        from kvpool.engine.sampling import SamplingParams

        self.eng = llm.engine
        self.sp = SamplingParams
        self.vocab = self.eng.model_config.vocab_size
        self.rng = np.random.default_rng(seed)
        self.prefixes: dict[int, list[int]] = {}
        self.n = 0

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(100, self.vocab - 1, n).tolist()

    def prefix(self, n: int) -> list[int]:
        """``n`` tokens the engine holds in its prefix cache."""
        if n not in self.prefixes:
            self.prefixes[n] = self.ids(n)
            self.add(self.prefixes[n], 1)
            self.drain()
        return self.prefixes[n]

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.n += 1
        self.eng.add_request(f"calib-{self.n}", prompt,
                             self.sp(temperature=0, max_tokens=max_tokens, ignore_eos=True))  # fmt: skip

    def step(self) -> tuple[float, int, int]:
        """(seconds, prefill tokens, decodes) of one engine step."""
        t0 = time.perf_counter()
        self.eng.step()
        dt = time.perf_counter() - t0
        p, d, _ = self.eng.step_times[-1]
        return dt, p, d

    def drain(self) -> None:
        while self.eng.has_unfinished_requests():
            self.eng.step()

    def prefill(self, n: int, context: int) -> StepSample:
        prompt = [*(self.prefix(context) if context else []), *self.ids(n)]
        self.add(prompt, 1)
        dt, p, _ = self.step()
        self.drain()
        return StepSample(p, len(prompt) - p, seconds=dt)

    def decode(self, batch: int, context: int, steps: int) -> list[StepSample]:
        """``batch`` sequences of ``context`` tokens (one cached prefix, one token of their
        own), timed over ``steps`` decode-only steps."""
        shared = self.prefix(context - 1)
        for _ in range(batch):
            self.add([*shared, *self.ids(1)], steps + 2)
        out, made = [], 0
        while self.eng.has_unfinished_requests() and len(out) < steps:
            dt, p, d = self.step()
            if p == 0:
                made += 1
                if d == batch:
                    out.append(StepSample(decodes=batch, decode_context=batch * (context + made),
                                          seconds=dt))  # fmt: skip
        self.drain()
        return out


def measure_steps(llm, quick: bool, say: Callable[[str], None]) -> list[StepSample]:
    d = _Driver(llm)
    d.prefill(128, 0)  # warm-up: the first steps allocate and pick kernels
    d.decode(4, 64, 2)
    prefills = [(32, 0), (128, 0), (384, 0), (128, 512)] if quick else \
        [(32, 0), (128, 0), (256, 0), (512, 0), (128, 512), (256, 1024)]  # fmt: skip
    batches = [1, 8, 32] if quick else [1, 2, 4, 8, 16, 32]
    contexts = [64, 512]
    repeats, steps = (1, 3) if quick else (2, 5)
    out = []
    say(f"{len(prefills) * repeats} prefill steps (prompt tokens, cached context): {prefills}")
    for n, p in prefills:
        out.extend(d.prefill(n, p) for _ in range(repeats))
    say(f"decode steps: batches {batches} x contexts {contexts}")
    for b in batches:
        for c in contexts:
            out.extend(d.decode(b, c, steps))
    return out


def measure_link(block_bytes: int, quick: bool) -> tuple[float, float, dict]:
    """(bytes/s, seconds per transfer, raw figures) of batched block READs over the transfer
    engine's shared memory."""
    from kvpool.transfer import Op, TransferEngine, TransferRequest

    counts = [1, 8, 32] if quick else [1, 4, 16, 64]
    xs, ys = [], []
    with TransferEngine() as owner, TransferEngine() as reader:
        owner.register("calibrate/kv", size=max(counts) * block_bytes)
        buf = np.zeros(max(counts) * block_bytes, np.uint8)
        for k in counts:
            times = []
            for _ in range(3 if quick else 7):
                reqs = [TransferRequest(Op.READ, buf[i * block_bytes:(i + 1) * block_bytes],
                                        "calibrate/kv", remote_offset=i * block_bytes)
                        for i in range(k)]  # fmt: skip
                t0 = time.perf_counter()
                reader.submit(reqs).wait(timeout=30)
                times.append(time.perf_counter() - t0)
            xs.append(k * block_bytes)
            ys.append(statistics.median(times))
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    bw = 1.0 / slope if slope > 0 else max(xs) / max(ys)
    return float(bw), max(float(intercept), 0.0), {"link_bytes": xs, "link_seconds": ys}


def model_spec(llm) -> tuple[ModelSpec, float]:
    """The engine's model as a ``ModelSpec`` and the weight bytes a decode step reads."""
    from kvpool.model.kv_layout import kv_bytes_per_block
    from kvpool.model.step_cost import step_cost

    eng = llm.engine
    c = eng.model_config
    per_elem = kv_bytes_per_block(eng.model, eng.block_size) / (
        eng.block_size * 2 * c.num_layers * c.num_kv_heads * c.head_dim)  # fmt: skip
    weights = float(step_cost(eng.model, 1, 0).weight_bytes)
    spec = ModelSpec(c.name, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
                     c.num_kv_heads, c.head_dim, c.vocab_size, kv_dtype_bytes=per_elem,
                     weight_bytes=weights)  # fmt: skip
    return spec, weights


def calibrate(cfg: CalibrationConfig, say: Callable[[str], None]) -> Profile:
    from kvpool import LLM

    t0 = time.perf_counter()
    threads = cfg.workers_threads
    say(f"loading the engine ({threads} thread(s), as each kvpool serve worker here)")
    llm = LLM(model=cfg.model, num_threads=threads, kv_cache_memory_bytes=cfg.kv_cache_memory)
    eng = llm.engine
    spec, weights = model_spec(llm)
    samples = measure_steps(llm, cfg.quick, say)
    fit = fit_steps(spec, samples, weights)
    say(f"fit: r2 {fit.r2:.4f}, worst step off by {fit.max_rel_error:.0%}"
        + (f"; no cost seen for {', '.join(fit.dropped)}" if fit.dropped else ""))  # fmt: skip
    block_bytes = int(spec.kv_bytes_per_token * eng.block_size)
    bw, overhead, link = measure_link(block_bytes, cfg.quick)
    say(f"link: {bw / 1e9:.2f} GB/s, {overhead * 1e3:.2f} ms per transfer")
    num_blocks = eng.pool.num_blocks
    sc = eng.config
    prefill_chunk = ClusterConfig().prefill_chunk  # kvpool serve's prefill workers' steps
    decode_chunk = ClusterConfig().decode_chunk  # and its decode workers'
    node = NodeSpec(**fit.node_fields(), max_batch=sc.max_num_seqs,
                    max_batched_tokens=sc.max_num_batched_tokens,
                    prefill_chunk_tokens=prefill_chunk or None,
                    decode_chunk_tokens=decode_chunk or None,
                    colocated_chunk_tokens=sc.max_num_batched_tokens,
                    kv_capacity_tokens=num_blocks * eng.block_size,
                    local_cache_blocks=num_blocks, threads=threads,
                    host_cores=os.cpu_count() or 1, decode_tail=True)  # fmt: skip
    pool = PoolSpec(blocks_per_node=max(1, int(cfg.pool_node_bytes) // block_bytes), nodes=1)
    measured = {"samples": [[s.prefill_tokens, s.prefill_context, s.decodes, s.decode_context,
                             s.seconds] for s in samples],
                "r2": fit.r2, "max_rel_error": fit.max_rel_error, "dropped": list(fit.dropped),
                "seconds": time.perf_counter() - t0, "cpus": os.cpu_count(),
                "load_average": list(os.getloadavg()), **link}  # fmt: skip
    return Profile(cfg.name, spec, node, NetworkSpec(bw, overhead), pool, eng.block_size,
                   description=f"{spec.name} on this machine's CPU, measured by kvpool sim "
                               "calibrate: one node = one kvpool worker, every node on this "
                               "one host (host_cores)",
                   sources=("kvpool sim calibrate: the real engine's steps, fitted (measured "
                            "samples below); the link: the transfer engine's shared memory",),
                   assumptions=(
                       "compute and memory times add up (a CPU does not overlap them)",
                       f"nodes share this host's {os.cpu_count()} cores (processor sharing: "
                       "while n nodes step, each runs at min(1, cores / (n x threads)) of its "
                       "speed alone); the conductor, the pool and the client are not counted",
                       "serving limits are kvpool serve's defaults (1 GiB KV per worker, "
                       "a 1 GiB pool node, 64 sequences, 2048 tokens per step, "
                       f"{prefill_chunk} on prefill workers, {decode_chunk} on decode "
                       "workers)",
                       "per-request HTTP and RPC costs are not measured: only the link's "
                       "fixed cost per transfer",
                       "decode_tail: kvpool's decode worker reads the prompt's full blocks "
                       "and computes the rest of the prompt itself"),
                   measured=measured)  # fmt: skip
