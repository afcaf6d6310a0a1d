"""Decode steps with the weights and KV cache on huge pages against torch's own allocations.

Two engines on the same model in one process: one built with ``KVPOOL_HUGEPAGES=0`` (every
tensor where torch put it, on 4 KB pages) and one with the default (the block weights copied
into one arena in the order a step reads them, everything advised ``MADV_HUGEPAGE``:
``src/kvpool/model/hugepages.py``). Rounds alternate the two on the same prompts (random
tokens, greedy, EOS ignored), same threads; a row is the median decode step of each round,
the ratio the median over rounds of (torch's step / arena's step). Both must produce the same
tokens.

    python benchmarks/bench_hugepages.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, log


def build(on: bool, batches: list[int], context: int, new_tokens: int):
    from kvpool.engine.llm import LLM

    before = os.environ.get("KVPOOL_HUGEPAGES")
    os.environ["KVPOOL_HUGEPAGES"] = "1" if on else "0"
    try:
        return LLM(None, weights="q4", max_num_seqs=max(batches), kv_cache_memory_bytes="2GiB",
                   max_model_len=context + new_tokens + 1)  # fmt: skip
    finally:
        if before is None:
            os.environ.pop("KVPOOL_HUGEPAGES", None)
        else:
            os.environ["KVPOOL_HUGEPAGES"] = before


def tokens(llm, batch: int, context: int, seed: int) -> list[list[int]]:
    """Four greedy tokens of each of ``batch`` prompts (the two engines must agree)."""
    from kvpool.bench.roofline import _prompts
    from kvpool.engine.sampling import SamplingParams

    prompts = _prompts(llm.engine.model_config.vocab_size, batch, context, seed)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of batch 1 and 8")
    ap.add_argument("--json", metavar="PATH", help="write figures and ratios as JSON")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    from kvpool.bench.roofline import measure_decode

    rounds = 3 if args.quick else args.rounds
    batches = [1, 8] if args.quick else [1, 8, 32]
    res = Results("hugepages", vars(args))
    log("building both engines (torch's allocations, then the huge-page arena)")
    systems = {"torch": build(False, batches, args.context, args.new_tokens),
               "arena": build(True, batches, args.context, args.new_tokens)}  # fmt: skip
    same = all(tokens(systems["torch"], b, args.context, 7)
               == tokens(systems["arena"], b, args.context, 7) for b in batches)  # fmt: skip
    res.figure("same_tokens", float(same))
    if not same:
        raise SystemExit("the two engines generated different tokens")
    steps: dict[tuple[str, int], list[float]] = {(s, b): [] for s in systems for b in batches}
    for r in range(rounds):
        for b in batches:
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                s = measure_decode(systems[name], b, args.context, args.new_tokens, seed=r)
                steps[(name, b)].append(s)
            log(f"round {r + 1}/{rounds} batch {b}: torch {steps[('torch', b)][-1] * 1e3:.2f} ms, "
                f"arena {steps[('arena', b)][-1] * 1e3:.2f} ms")  # fmt: skip
    for b in batches:
        for name in systems:
            res.figure(f"decode_b{b}_{name}_step_ms", statistics.median(steps[(name, b)]) * 1e3)
        per_round = [t / a for t, a in zip(steps[("torch", b)], steps[("arena", b)], strict=True)]
        res.ratios[f"decode_b{b}_arena_speedup"] = round(statistics.median(per_round), 3)
        log(f"decode_b{b}_arena_speedup = {res.ratios[f'decode_b{b}_arena_speedup']:.2f}x")
    res.dump(args.json)


if __name__ == "__main__":
    main()
