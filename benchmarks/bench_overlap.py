"""Do prefix loads from the pool stall running decodes? Asynchronous loads against the old
synchronous path, on the same engine, model, pool and work, in one run.

A pool (``kvpool store master`` + one ``kvpool store node``, separate processes; the engine
reads it over ``--transport``, TCP by default: a decode host and a store host) holds
``--prefixes`` prompts of ``--prefix-tokens`` tokens, computed once. Each round, for each mode
(order rotated round by round):

- ``async``: ``--streams`` decode streams run for ``--window`` steps; every ``--every`` steps
  ``--burst`` requests arrive whose prompts are the pool's prefixes plus one fresh token (one
  token to compute, like a decode); the engine's own prefix cache is emptied first, so every
  prefix is loaded from the pool, in the background: ``StoreConnector(async_load=True)``;
- ``sync``: the same with ``StoreConnector(async_load=False)``: the lookup RPC and the load run
  inside the engine step (what kvpool did before);
- ``local``: the same arrivals, their prefixes already in the engine's own cache: the same
  compute with no load at all (the "no loads" reference: a request's first decode over a
  1,024-token context costs what it costs, loaded or not);
- ``streams``: the streams alone, nothing arrives (context: what the arrivals' own compute adds);
- ``async_late``: ``async`` with the pool lookup issued when the scheduler first considers a
  request (``StoreConnector(arrival_lookups=False)``, what kvpool did before) instead of when
  it arrives.
- ``async_nice0``: ``async`` with the background lookup and load threads at the engine's own
  CPU priority (``StoreConnector(load_nice=0)``) instead of nice 5 (the default): at equal
  priority the loads take their share of the cores from the streams, whose steps then wait at
  every barrier for a descheduled thread; at nice 5 they run in what the engine's threads
  leave, so the loaded request waits longer for its first token.

Each arrival's time to first token (from ``add_request`` to its one token) is recorded too:
``arrival_ttft_p50_late_vs_arrival`` = async_late / async, the median over rounds of each
round's p50 (higher: looking up on arrival admits a burst sooner);
``arrival_ttft_p50_nice5_vs_nice0`` = async / async_nice0 (higher: the lower priority costs the
loaded requests) and ``tbt_p99_nice0_vs_nice5`` = async_nice0 / async (higher: the equal
priority costs the streams).

The streams' time between tokens (TBT) is measured inside the window; per mode the figure is
the median over rounds of each round's p99. ``tbt_p99_loads_vs_idle`` = async / local (target
<= 1.3), ``tbt_p99_sync_vs_async`` = sync / async (target >= 2),
``tbt_p99_arrivals_vs_streams_only`` = local / streams. ``load_hidden_share``: of the
time loads ran (async), the share during which the engine computed something else (1 - the
time steps sat idle waiting for a load / load time; on the synchronous path every load blocks
the step: 0). What the loads still cost the streams (CPU and memory bandwidth they share with
the compute) shows in the TBT ratios. ``save_hidden_share``: the prefixes are computed
while the streams decode; of the time saves ran, the share nobody waited for (1 - time spent in
``wait_saved`` at the end / save time).

    .venv/bin/python benchmarks/bench_overlap.py --quick
    .venv/bin/python benchmarks/bench_overlap.py --json docs/results/bench_overlap.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import CACHE, KvpoolProcs, Results, log  # noqa: E402

MODES = ("local", "async", "sync", "streams", "async_late", "async_nice0")


class Pool:
    """A master and one storage node as ``kvpool`` processes (the master is the directory)."""

    def __init__(self, memory: str) -> None:
        self.procs = KvpoolProcs(CACHE / "overlap-logs", {**os.environ, "KVPOOL_AUTH_TOKEN": ""})
        try:
            master = self.procs.start("master", "store", "master", "--port", "0")
            self.master = master["address"].replace("tcp://", "")
            self.procs.start("node", "store", "node", "--master", self.master, "--memory",
                             memory, "--node-id", "overlap-node")  # fmt: skip
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.procs.close()


def make_engine(model, args, pool: Pool, async_load: bool, arrival_lookups: bool = True,
                load_nice: int | None = None):  # fmt: skip
    from kvpool.config import EngineConfig, TransferConfig
    from kvpool.engine.connectors.store import StoreConnector
    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.store import StoreClient

    # spin_us=0 as in ``kvpool worker``: a thread polling for a pool reply takes CPU (and the
    # GIL) from the model's compute
    client = StoreClient(pool.master, TransferConfig(transport=args.transport, auth_token="",
                                                     spin_us=0), token="")  # fmt: skip
    nice = {} if load_nice is None else {"load_nice": load_nice}  # None: the default
    conn = StoreConnector(client, async_load=async_load, arrival_lookups=arrival_lookups, **nice)
    cfg = EngineConfig(kv_cache_memory_bytes=args.kv_memory, num_threads=args.threads,
                       max_num_batched_tokens=args.prefix_tokens + 64)  # fmt: skip
    return LLMEngine(cfg, model, conn), client


def streams_window(eng, args, prefixes: list[list[int]] | None, rng: random.Random,
                   local: bool = False) -> dict:  # fmt: skip
    """Run the decode streams for ``--window`` steps, admitting ``--burst`` prefix requests
    every ``--every`` steps when ``prefixes``; the streams' TBTs in the window and load
    figures. ``local``: the prefixes are in the engine's own cache first (no load at all)."""
    from kvpool import SamplingParams

    eng.reset_prefix_cache()
    if local and prefixes:
        prime = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for i, p in enumerate(prefixes):
            eng.add_request(f"prime{i}-{rng.random()}", [*p, rng.randrange(1000, 20000)], prime)
        while eng.has_work():
            eng.step()
    stream_sp = SamplingParams(temperature=0, max_tokens=args.window + 16, ignore_eos=True)
    ids = [f"s{i}-{rng.random()}" for i in range(args.streams)]
    for rid in ids:
        eng.add_request(rid, [rng.randrange(1000, 20000) for _ in range(32)], stream_sp)
    while min(len(eng.requests[r].output_token_ids) for r in ids) < 2:
        eng.step()  # prefill the streams; from here on every step decodes each of them
    last = {r: time.perf_counter() for r in ids}
    gaps: list[float] = []
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    stall0, sched = eng.load_stall_seconds, eng.scheduler.stats
    loads0, prefetch = sched.loads_started, getattr(eng.connector, "_prefetch", None)
    load_s0 = prefetch.load_seconds if prefetch else 0.0
    conn_load0 = eng.connector.stats.load_seconds
    arrived, added, ttfts = 0, {}, []
    for step in range(args.window):
        due = arrived
        if prefixes and step % args.every == 0:  # a burst of arrivals
            due = min(len(prefixes), (step // args.every + 1) * args.burst)
        while arrived < due:
            # one fresh token: the request's own compute is one row, like a decode
            fresh = [rng.randrange(1000, 20000)]
            rid = f"p{arrived}-{rng.random()}"
            added[rid] = time.perf_counter()
            eng.add_request(rid, prefixes[arrived] + fresh, one)
            arrived += 1
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in added and o.outputs[0].token_ids:
                ttfts.append(now - added.pop(o.request_id))
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
                last[o.request_id] = now
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_work():
        outs = eng.step()  # finish the prefix requests
        now = time.perf_counter()
        for o in outs:
            if o.request_id in added and o.outputs[0].token_ids:
                ttfts.append(now - added.pop(o.request_id))
    out = {"tbt_p99": pct(gaps, 0.99), "tbt_p50": pct(gaps, 0.50), "samples": len(gaps),
           "ttft_p50": pct(ttfts, 0.50), "ttfts": len(ttfts),
           "loads": sched.loads_started - loads0,
           "stall_s": eng.load_stall_seconds - stall0,
           "load_s": (prefetch.load_seconds - load_s0) if prefetch else
                     eng.connector.stats.load_seconds - conn_load0}  # fmt: skip
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def compute_prefixes(eng, args, rng: random.Random) -> tuple[list[list[int]], float, float]:
    """Compute the prefixes (while decode streams run) so the pool holds them; (prefixes,
    save seconds, seconds waited for saves at the end)."""
    from kvpool import SamplingParams

    conn = eng.connector
    prefixes = [[rng.randrange(1000, 20000) for _ in range(args.prefix_tokens)]
                for _ in range(args.prefixes)]  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(args.streams):
        eng.add_request(f"bg{i}", [rng.randrange(1000, 20000) for _ in range(32)], sp)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    save0, wait0 = conn.stats.save_seconds, conn.stats.save_wait_seconds
    for i, p in enumerate(prefixes):
        eng.add_request(f"warm{i}", p, one)
        for _ in range(2):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    hashes = eng.pool.cached_hashes()
    if not conn.wait_saved(list(hashes), 120):
        raise RuntimeError("saves to the pool did not finish in 120 s")
    return prefixes, conn.stats.save_seconds - save0, conn.stats.save_wait_seconds - wait0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds, 4 prefixes (about 2 min)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8, help="prefix requests per window")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=40, help="decode steps measured per mode")
    ap.add_argument("--every", type=int, default=8, help="steps between bursts of arrivals")
    ap.add_argument("--burst", type=int, default=4, help="prefix requests arriving at once")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm", "auto"))
    ap.add_argument("--threads", type=int, default=2, help="torch threads (same for all modes)")
    ap.add_argument("--kv-memory", default="768MiB")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.prefixes, args.window = 3, 4, 24
    import torch

    from kvpool.model.loader import load_model

    res = Results("overlap", vars(args))
    rng = random.Random(args.seed)
    model = load_model(None, torch.float32)
    pool = Pool("3GiB")
    engines = {}
    try:
        engines["async"] = make_engine(model, args, pool, True)
        engines["sync"] = make_engine(model, args, pool, False)
        engines["async_late"] = make_engine(model, args, pool, True, arrival_lookups=False)
        engines["async_nice0"] = make_engine(model, args, pool, True, load_nice=0)
        log(f"computing {args.prefixes} prefixes of {args.prefix_tokens} tokens into the pool")
        prefixes, save_s, wait_s = compute_prefixes(engines["async"][0], args, rng)
        res.figure("save_seconds", save_s)
        res.figure("save_wait_seconds", wait_s)
        res.figure("save_hidden_share", 1 - wait_s / save_s if save_s else float("nan"))
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for rnd in range(args.rounds):
            k = rnd % len(MODES)
            for mode in MODES[k:] + MODES[:k]:
                eng = engines[mode if mode in engines else "async"][0]
                r = streams_window(eng, args, None if mode == "streams" else prefixes, rng,
                                   local=mode == "local")  # fmt: skip
                runs[mode].append(r)
            log(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{m} p99 {runs[m][-1]['tbt_p99'] * 1e3:.1f} ms" for m in MODES))  # fmt: skip
        report(res, runs, args)
    finally:
        for eng, client in engines.values():
            eng.close()
            client.close()
        pool.close()
    res.dump(args.json)


def report(res: Results, runs: dict[str, list[dict]], args) -> None:
    med = {m: statistics.median(r["tbt_p99"] for r in runs[m]) for m in MODES}
    for m in MODES:
        res.figure(f"{m}_tbt_p99_ms", med[m] * 1e3)
        res.figure(f"{m}_tbt_p50_ms", statistics.median(r["tbt_p50"] for r in runs[m]) * 1e3)
    for m in ("async", "sync"):
        loads = sum(r["loads"] for r in runs[m])
        res.figure(f"{m}_load_seconds", sum(r["load_s"] for r in runs[m]))
        res.figure(f"{m}_stall_seconds", sum(r["stall_s"] for r in runs[m]))
        if m == "async":
            res.figure("async_loads", loads)
    load_s = sum(r["load_s"] for r in runs["async"])
    stall = sum(r["stall_s"] for r in runs["async"])
    res.figure("load_hidden_share", 1 - stall / load_s if load_s else float("nan"))
    res.ratio("tbt_p99_loads_vs_idle", med["async"], med["local"], higher_is_better=False)
    res.ratio("tbt_p99_arrivals_vs_streams_only", med["local"], med["streams"],
              higher_is_better=False)  # fmt: skip
    res.ratio("tbt_p99_sync_vs_async", med["sync"], med["async"])
    per_round = [s["tbt_p99"] / a["tbt_p99"] for s, a in zip(runs["sync"], runs["async"],
                                                             strict=True)]  # fmt: skip
    res.figure("sync_vs_async_per_round_min", min(per_round))
    ttft = {m: statistics.median(r["ttft_p50"] for r in runs[m]) for m in MODES if m != "streams"}
    for m, v in ttft.items():
        res.figure(f"{m}_arrival_ttft_p50_ms", v * 1e3)
    res.ratio("arrival_ttft_p50_late_vs_arrival", ttft["async_late"], ttft["async"])
    res.ratio("arrival_ttft_p50_nice5_vs_nice0", ttft["async"], ttft["async_nice0"])
    res.ratio("tbt_p99_nice0_vs_nice5", med["async_nice0"], med["async"], higher_is_better=False)
    for m in ("async", "async_nice0"):  # how long a background load of one prefix took
        loads = sum(r["loads"] for r in runs[m])
        res.figure(f"{m}_seconds_per_load", sum(r["load_s"] for r in runs[m]) / max(1, loads))


if __name__ == "__main__":
    main()
