"""``kvpool roofline``: this machine's limits, and decode against them (CLI: prints are fine).

Measures the read and copy bandwidth and the GEMM rates (cached per CPU, ``--fresh`` to
measure again), then runs decode steps of the engine at each batch size and prints, per batch:
the bytes a step moves (weights and KV), the bandwidth achieved and its share of the machine's
read bandwidth over a working set of those bytes ("ceil GB/s": where they fit in the last-level
cache, faster than memory; "of mem": the share of the bandwidth from memory), both ceilings on
tokens/s, the bound that applies and how close the engine comes. It runs every batch
``--rounds`` times, each round beside fresh probes of the read bandwidth (a shared VM's drifts
by tens of percent within minutes): each share is against its own round's probes,
and a batch's row is its round of median share (all rounds in the JSON). Writes
``roofline.json`` and ``roofline.png`` (achieved against the ceilings) into ``--out``.
With ``--master`` the engine's KV connector uses that pool: each batch runs twice, the second
time from the pool, and the report says where the KV came from and what loading it cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("roofline", help="decode against this machine's bandwidth and "
                                               "compute ceilings")  # fmt: skip
    p.add_argument("--model", default=None, help="a .gguf file or folder (default: SmolLM2)")
    p.add_argument("--weights", default="auto", choices=["auto", "q4", "int8", "float32"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--batches", default="1,2,4,8,16,32", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=24, help="decode steps per batch")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every batch, each beside a fresh bandwidth probe; a batch's "
                        "row is its round of median share")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--master", default=None, help="a store master HOST:PORT: KV from the pool")
    p.add_argument("--fresh", action="store_true", help="measure the machine again")
    p.add_argument("--out", default="roofline-out", help="folder for roofline.json / .png")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=run)


def _batches(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"kvpool roofline: --batches takes integers, got {text!r}") from None
    if not out or out[0] < 1:
        raise SystemExit("kvpool roofline: --batches must be positive integers")
    return out


def run(args: argparse.Namespace) -> int:
    from kvpool.bench import roofline as rl
    from kvpool.common.errors import KVPoolError
    from kvpool.common.log import setup_logging
    from kvpool.engine.llm import LLM
    from kvpool.model.kernels import kernels
    from kvpool.model.machine import read_gbps

    setup_logging(args.log_level)
    batches = _batches(args.batches)
    if args.context < 1 or args.new_tokens < 2 or args.rounds < 1:
        raise SystemExit("kvpool roofline: --context >= 1, --new-tokens >= 2, --rounds >= 1")
    limits = rl.machine_limits(kernels(), fresh=args.fresh)
    print(f"machine: {limits.cpu}, {limits.threads} threads: read {limits.read_gbps:.1f} GB/s, "
          f"copy {limits.copy_gbps:.1f} GB/s, float32 GEMM {limits.gemm_gflops:.0f} GFLOP/s, "
          f"block kernel {limits.block_rate(1):.0f}-{limits.block_rate(64):.0f} GOP/s "
          "(1-64 rows); read over working sets of "
          + ", ".join(f"{n >> 20} MB {g:.1f}" for n, g in sorted(limits.read_curve.items()))
          + " GB/s")  # fmt: skip
    connector = client = None
    if args.master:
        connector, client = _pool_connector(args.master)
    try:
        llm = LLM(args.model, weights=args.weights, kv_cache_dtype=args.kv_cache_dtype,
                  num_threads=args.threads, max_num_seqs=max(batches),
                  max_model_len=args.context + args.new_tokens + 1, connector=connector)  # fmt: skip
    except (KVPoolError, ValueError) as exc:
        print(f"kvpool roofline: {exc}", file=sys.stderr)
        return 1
    model = llm.engine.model
    print(f"model: {llm.engine.model_config.name}, weights {model.weight_format}, KV "
          f"{model.kv_format}; context {args.context} tokens")  # fmt: skip
    print(
        f"{'batch':>5} {'step ms':>8} {'weights MB':>10} {'KV MB':>7} {'GB/s':>6} "
        f"{'ceil GB/s':>9} {'of ceil':>7} {'of mem':>6} {'tok/s':>7} {'bw ceil':>8} "
        f"{'cpu ceil':>8} {'share':>6}  bound"
    )
    # a shared VM's bandwidth drifts by tens of percent within minutes: each round measures it
    # again beside its decode steps, and a share is always against its own round's probe
    runs: dict[int, list] = {b: [] for b in batches}
    probes = []
    for r in range(args.rounds):
        now = replace(limits, read_gbps=read_gbps())
        probes.append(now.read_gbps)
        for b in batches:
            cost = rl.step_cost(model, b, args.context)
            step = rl.measure_decode(llm, b, args.context, args.new_tokens)
            # the bandwidth over the step's own bytes (cache-resident where they fit), now
            runs[b].append(rl.analyze(now, cost, b, args.context, step, read_gbps(cost.bytes)))
        print(f"round {r + 1}/{args.rounds}: read {now.read_gbps:.1f} GB/s, batch-{batches[0]} "
              f"share {runs[batches[0]][-1].share:.2f}", file=sys.stderr)  # fmt: skip
    rows, sources, rounds = [], [], {}
    for b in batches:
        row = sorted(runs[b], key=lambda x: x.share)[(len(runs[b]) - 1) // 2]
        rows.append(row)
        rounds[b] = [{"step_s": x.step_s, "share": x.share, "read_gbps": gbps,
                      "working_set_gbps": x.read_gbps, "memory_share": x.memory_share}
                     for x, gbps in zip(runs[b], probes, strict=True)]  # fmt: skip
        print(f"{b:>5} {row.step_s * 1e3:>8.2f} {row.weight_mb:>10.1f} {row.kv_mb:>7.1f} "
              f"{row.achieved_gbps:>6.2f} {row.read_gbps:>9.1f} {row.bandwidth_share:>7.2f} "
              f"{row.memory_share:>6.2f} {row.tok_s:>7.1f} "
              f"{row.bandwidth_ceiling_tok_s:>8.1f} {row.compute_ceiling_tok_s:>8.1f} "
              f"{row.share:>6.2f}  {row.verdict}  (rounds: "
              f"{', '.join(f'{x.share:.2f}' for x in runs[b])})")  # fmt: skip
        if connector is not None:
            sources.append(_from_pool(llm, connector, b, args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": asdict(limits), "model": llm.engine.model_config.name,
              "weights": model.weight_format, "kv_format": model.kv_format,
              "context": args.context, "rounds": args.rounds,
              "rows": [asdict(r) | {"verdict": r.verdict, "rounds": rounds[r.batch]}
                       for r in rows],
              "kv_sources": sources}  # fmt: skip
    (out / "roofline.json").write_text(json.dumps(report, indent=1))
    rl.plot(rows, limits, f"{llm.engine.model_config.name} ({model.weight_format} weights, "
            f"{args.context}-token context)", out / "roofline.png")  # fmt: skip
    print(f"wrote {out / 'roofline.json'} and {out / 'roofline.png'}")
    llm.engine.close()
    if client is not None:
        client.close()
    return 0


def _pool_connector(master: str):
    from kvpool.config import TransferConfig
    from kvpool.engine.connectors.store import StoreConnector
    from kvpool.store.client import StoreClient

    client = StoreClient(master, TransferConfig(spin_us=0))
    # every prefix the pool holds is loaded, inside the step (no fetch policy, no race with a
    # background lookup): the report shows what loading costs
    return StoreConnector(client, async_load=False, fetch_policy=False), client


def _from_pool(llm, connector, batch: int, args) -> dict:
    """The same prompts again with the engine's own cache emptied: their KV comes from the
    pool. Where it came from and what loading it cost."""
    from kvpool.bench.roofline import kv_sources

    report = kv_sources(llm, connector, batch, args.context, args.new_tokens)
    print(f"      KV of batch {batch}: {report['computed_tokens']} tokens computed, "
          f"{report['engine_tokens']} from the engine's cache, {report['pool_tokens']} from "
          f"the pool ({report['pool_load_s']:.3f} s of loads, "
          f"{report['pool_load_gbps']:.2f} GB/s)")  # fmt: skip
    return report
