"""Serving benchmark: disaggregated kvpool (1 prefill + 1 decode + the pool) against the
colocated baseline (``--colocated 2``: two engines, local prefix caching only), same machine,
same run, same workload.

Workload: scaled multi-turn chat with shared prefixes. Every session shares one system prompt
and has its own document; each turn appends the previous answer and a new question (so a turn's
prompt is the last turn's prompt plus new text). Sessions arrive as a Poisson process; a turn
is sent when the previous one has been answered (plus a think time). Streaming chat requests,
greedy, ``ignore_eos`` so every answer has ``--max-tokens`` tokens.

Reported per configuration: TTFT and TBT percentiles (TBT of a request = mean of its longest
10 % of inter-token gaps, as in the Mooncake paper; ITL p99 too), e2e, output throughput,
prefix hit rate (cached / prompt tokens, from ``usage``), the prompt tokens all engines
computed together and the share of looked-up prompt tokens they did not compute (from
``/cluster``; in the disaggregated setup each prompt is looked up twice, by the prefill and by
the decode worker, so compare the computed tokens), and failures. Ratios are
disaggregated over colocated.

  python benchmarks/bench_serving.py [--quick] [--rounds R] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, log

from kvpool.bench.launch import MEASURE_FLAGS, Served

MODEL = "SmolLM2-135M-Instruct"
CONFIGS = {
    "colocated": ["--colocated", "2"],
    "disaggregated": ["--prefill", "1", "--decode", "1"],
}
EXTRA = {
    "disaggregated_nochunk": ["--prefill", "1", "--decode", "1", "--prefill-chunk", "0"],
    "disaggregated_handoff_always": ["--prefill", "1", "--decode", "1",
                                     "--decode-prefill-tokens", "0"],
    "disaggregated_decode_prefill_128": ["--prefill", "1", "--decode", "1",
                                         "--decode-prefill-tokens", "128"],
    "disaggregated_no_lending": ["--prefill", "1", "--decode", "1",
                                 "--decode-prefill-gain", "0"],
    # each worker on its share of the cores, as before core sharing (engine/core_share.py)
    "disaggregated_no_share": ["--prefill", "1", "--decode", "1", "--no-share-cores"],
    "colocated_no_share": ["--colocated", "2", "--no-share-cores"],
    # not like-for-like (more torch threads than cores): their own rows
    "disaggregated_decode_2_threads": ["--prefill", "1", "--decode", "1",
                                       "--decode-threads", "2"],
    "colocated_2_threads": ["--colocated", "2", "--threads", "2"],
}  # fmt: skip
WORDS = ["river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "orchard",
         "signal", "thunder", "quiet", "marble", "falcon", "ember", "glacier", "willow",
         "canyon", "saffron", "pebble", "comet"]  # fmt: skip


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def workload(sessions: int, turns: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = "You are a careful assistant. Shared guidelines: " + _text(rng, 120)
    out = []
    for s in range(sessions):
        doc = f"Document {s}: " + _text(rng, 60)
        questions = [f"Question {t}: what does '{rng.choice(WORDS)}' mean here?"
                     for t in range(turns)]  # fmt: skip
        out.append({"system": system, "doc": doc, "questions": questions})
    return out


async def one_turn(client: httpx.AsyncClient, url: str, messages: list, max_tokens: int) -> dict:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    times, text, usage, status = [], "", None, 200
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        status = resp.status_code
        if status != 200:
            await resp.aread()
            return {"status": status, "text": ""}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                return {"status": 500, "text": text}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                delta = ch.get("delta", {}).get("content")
                if delta:
                    times.append(time.perf_counter())
                    text += delta
    gaps = sorted((b - a for a, b in itertools.pairwise(times)), reverse=True)
    top = gaps[: max(1, len(gaps) // 10)] if gaps else []
    return {
        "status": status, "text": text,
        "ttft": times[0] - t0 if times else None,
        "tbt": statistics.fmean(top) if top else None,
        "gaps": gaps, "e2e": time.perf_counter() - t0,
        "prompt_tokens": (usage or {}).get("prompt_tokens", 0),
        "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "output_tokens": (usage or {}).get("completion_tokens", 0),
    }  # fmt: skip


async def session(client, url, sess, delay, args, results: list, progress: dict) -> None:
    await asyncio.sleep(delay)
    messages = [{"role": "system", "content": sess["system"] + "\n" + sess["doc"]}]
    for q in sess["questions"]:
        messages.append({"role": "user", "content": q})
        r = await one_turn(client, url, messages, args.max_tokens)
        results.append(r)
        progress["done"] += 1
        if progress["done"] % 5 == 0 or progress["done"] == progress["total"]:
            log(f"  {progress['done']}/{progress['total']} requests done")
        if r["status"] != 200:
            return
        messages.append({"role": "assistant", "content": r["text"]})
        await asyncio.sleep(args.think)


async def replay(url: str, sessions: list[dict], args) -> tuple[list[dict], float]:
    rng = random.Random(args.seed)
    delays, t = [], 0.0
    for _ in sessions:
        delays.append(t)
        t += rng.expovariate(args.rate)
    results: list[dict] = []
    progress = {"done": 0, "total": len(sessions) * args.turns}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.wait_for(asyncio.gather(*(session(client, url, s, d, args, results, progress)
                                                for s, d in zip(sessions, delays, strict=True))),
                               timeout=args.budget)  # fmt: skip
    return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(results: list[dict], seconds: float, cluster: dict) -> tuple[dict, dict]:
    """(figures of one run, its TTFT and TBT samples)."""
    ok = [r for r in results if r["status"] == 200 and r.get("ttft") is not None]
    ttft, tbt = [r["ttft"] for r in ok], [r["tbt"] for r in ok if r["tbt"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    counters = [w["counters"] for w in cluster.get("workers", [])]
    queries = sum(c.get("prefix_queries", 0) for c in counters)
    hits = sum(c.get("prefix_hits_local", 0) + c.get("prefix_hits_pool", 0) for c in counters)
    figs = {
        "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": pct(ttft, 0.9),
        "ttft_p99_s": pct(ttft, 0.99), "tbt_p50_s": statistics.median(tbt),
        "tbt_p90_s": pct(tbt, 0.9), "tbt_p99_s": pct(tbt, 0.99), "itl_p99_s": pct(gaps, 0.99),
        "e2e_p50_s": statistics.median(r["e2e"] for r in ok),
        "output_tok_per_s": sum(r["output_tokens"] for r in ok) / seconds,
        "requests_ok": len(ok), "requests_failed": len(results) - len(ok),
        "prefix_hit_rate": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
        "prefill_compute_saved": hits / queries if queries else 0.0,
        "engine_prompt_tokens_computed": queries - hits,
    }  # fmt: skip
    save = sum(c.get("pool_save_seconds", 0.0) for c in counters)
    if save:  # share of the time spent publishing KV that compute hid (prefill hand-offs wait)
        wait = sum(c.get("pool_save_wait_seconds", 0.0) for c in counters)
        figs["kv_save_hidden_ratio"] = max(0.0, 1 - wait / save)
        figs["kv_save_seconds"] = save
        load = sum(c.get("pool_load_seconds", 0.0) for c in counters)
        compute = sum(c.get("compute_seconds", 0.0) for c in counters)
        figs["kv_load_vs_compute_ratio"] = load / compute if compute else 0.0
    loaded = sum(c.get("pool_loaded_bytes", 0) for c in counters)
    if loaded:  # of the KV decode workers loaded, the share read straight from a prefill worker
        figs["kv_direct_share"] = sum(c.get("direct_read_bytes", 0) for c in counters) / loaded
    return figs, {"ttft": ttft, "tbt": tbt}


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft", "TTFT (s)"), (axes[1], "tbt", "TBT (s)")):
        for name, c in curves.items():
            xs = sorted(c[key])
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("kvpool serving: disaggregated vs colocated (same workload)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 sessions x 3 turns (about 4 min)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.5, help="sessions started per second")
    ap.add_argument("--think", type=float, default=0.5, help="seconds between turns")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget", type=float, default=900, help="seconds per configuration")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every configuration, alternating (order reversed every other "
                         "round); figures are medians over rounds, ratios those of the medians (with the per-round range)")  # fmt: skip
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma list of {', '.join({**CONFIGS, **EXTRA})}")  # fmt: skip
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--png", metavar="PATH")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns = 8, 3
    res = Results("bench_serving", vars(args))
    sessions = workload(args.sessions, args.turns, args.seed)
    curves = {}
    logdir = Path(".cache/bench/serving")
    logdir.mkdir(parents=True, exist_ok=True)
    configs = {**CONFIGS, **EXTRA}
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in configs]
    if unknown:
        ap.error(f"unknown configs {unknown}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            flags = ["--kv-cache-memory", "512MiB", "--store-memory", "1GiB", *MEASURE_FLAGS,
                     *configs[name]]  # fmt: skip
            log(f"round {rnd + 1}/{args.rounds} {name}: kvpool serve {' '.join(configs[name])}")
            served = Served(flags, logdir / f"{name}.log")
            try:
                log(f"{name}: replaying {args.sessions} sessions x {args.turns} turns")
                results, seconds = asyncio.run(replay(served.url, sessions, args))
                cluster = httpx.get(f"{served.url}/cluster", timeout=10).json()
            finally:
                served.stop()
            figs, samples = summarize(results, seconds, cluster)
            runs[name].append(figs)
            curves.setdefault(name, {"ttft": [], "tbt": []})
            for k in ("ttft", "tbt"):
                curves[name][k] += samples[k]
            log(f"{name}: TTFT p50 {figs['ttft_p50_s']:.3f}s, TBT p50 {figs['tbt_p50_s']:.3f}s, "
                f"hit rate {figs['prefix_hit_rate']:.2f}, {figs['output_tok_per_s']:.1f} tok/s")  # fmt: skip
    for name, figs in runs.items():
        for k in figs[0]:
            res.figure(f"{name}_{k}", statistics.median(r[k] for r in figs if k in r))
    if not {"colocated", "disaggregated"} <= set(names):
        res.dump(args.json)
        return
    f = res.figures
    for key, better in (("ttft_p50_s", False), ("ttft_p99_s", False), ("tbt_p50_s", False),
                        ("tbt_p99_s", False), ("output_tok_per_s", True),
                        ("engine_prompt_tokens_computed", False)):  # fmt: skip
        res.ratio(f"disagg_vs_colocated_{key}", f[f"disaggregated_{key}"], f[f"colocated_{key}"],
                  higher_is_better=better)  # fmt: skip
        if args.rounds > 1:  # the same ratio round by round (the runs of one round are adjacent)
            per = [d[key] / c[key] for d, c in zip(runs["disaggregated"], runs["colocated"],
                                                    strict=True) if c[key]]  # fmt: skip
            res.figure(f"disagg_vs_colocated_{key}_round_min", min(per))
            res.figure(f"disagg_vs_colocated_{key}_round_max", max(per))
    res.dump(args.json)
    if args.png:
        plot(curves, args.png)


if __name__ == "__main__":
    main()
