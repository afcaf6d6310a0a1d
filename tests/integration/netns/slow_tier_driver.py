"""Runs inside the decode host of ``test_slow_tier.py``: one engine process, the real model,
the pool across a link the test shapes. For a short and a long prefix that the pool holds, the
time to first token three ways: recomputed (no connector), always loaded
(``fetch_policy=False``) and decided (the default policy), each while a decode stream runs;
one JSON line per link (see ``main``)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from kvpool import SamplingParams
from kvpool.config import EngineConfig, TransferConfig
from kvpool.engine.connectors.store import StoreConnector
from kvpool.engine.llm_engine import LLMEngine
from kvpool.model.loader import load_model
from kvpool.store import StoreClient


def engine(model, master: str | None, policy: bool) -> LLMEngine:
    conn = None
    if master:
        client = StoreClient(master, TransferConfig(host=ARGS.host, transport="tcp"))
        conn = StoreConnector(client, fetch_policy=policy)
    cfg = EngineConfig(kv_cache_memory_bytes="512MiB", num_threads=1, max_num_batched_tokens=2048)
    return LLMEngine(cfg, model, conn)


def close(eng: LLMEngine) -> None:
    eng.close()
    eng.connector.client.close()


def finish(eng: LLMEngine) -> None:
    """Run ``eng`` dry, and wait for its saves: the next engine measured must not share the
    shaped link with this one's background writes (the stream's blocks)."""
    while eng.has_work():
        eng.step()
    if isinstance(eng.connector, StoreConnector):
        assert eng.connector.wait_saved(list(eng.pool.cached_hashes()), 120)


def ttft(eng: LLMEngine, prompt: list[int], rng: random.Random) -> float:
    """Seconds to the first token of ``prompt`` while a decode stream runs (cache emptied)."""
    finish(eng)
    eng.reset_prefix_cache()
    stream = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    eng.add_request("stream", [rng.randrange(1000, 20000) for _ in range(16)], stream)
    for _ in range(3):
        eng.step()
    rid = f"q{rng.random()}"
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1))
    while rid in eng.requests:
        eng.step()
    took = time.perf_counter() - t0
    eng.abort_request("stream")
    finish(eng)
    return took


LENGTHS = {"short": 33, "long": 513}  # 2 and 32 full blocks, then one token to compute


def fitted(eng: LLMEngine, rng: random.Random) -> LLMEngine:
    """``eng`` after four prompts of new lengths, from 2 to 25 blocks: its step-cost model fits
    their prefills (and an engine with the pool, the second to see them, measures their loads,
    short ones too: fitted to 4-25 blocks only, the line's intercept put a 2-block load at twice
    its time, and with prompts on the block kernel that tipped the short prefix to recompute)."""
    for n in (33, 65, 257, 401):
        ttft(eng, [rng.randrange(1000, 20000) for _ in range(n)], rng)
    return eng


def main() -> None:
    """Warm the pool with both prefixes (the link is not shaped yet), then print this machine's
    recompute time of the long prefix and the bytes a load of it moves (the link rates that make
    loading pay, or not, follow from them); then, for each ``measure NAME`` line on stdin (sent
    once the link is shaped), one JSON line of time-to-first-token medians and decisions, with
    fresh pool engines (whose load figures are this link's) against the same recompute engine."""
    rng = random.Random(5)
    model = load_model(None, torch.float32)
    prompts = {k: [rng.randrange(1000, 20000) for _ in range(n)] for k, n in LENGTHS.items()}
    warm = engine(model, ARGS.master, policy=False)
    for p in prompts.values():
        warm.add_request(f"w{rng.random()}", p, SamplingParams(max_tokens=1))
        finish(warm)
    close(warm)
    recompute = fitted(engine(model, None, False), rng)
    kv = recompute.runner.kv_cache  # [blocks, ...]: one block's bytes, as the pool stores them
    blocks = LENGTHS["long"] // recompute.block_size
    cal = {"recompute_s": ttft(recompute, prompts["long"], rng),
           "bytes": blocks * kv[0].numel() * kv.element_size()}  # fmt: skip
    print(json.dumps(cal), flush=True)
    for line in sys.stdin:
        if not line.startswith("measure"):
            break
        modes = {"recompute": recompute, "load": engine(model, ARGS.master, False)}
        modes["auto"] = engine(model, ARGS.master, True)
        seed = rng.random()
        for eng in modes.values():  # the same new prompts: "load" saves them, "auto" loads them
            fitted(eng, random.Random(seed))
        print(json.dumps(measure(modes, prompts, rng)), flush=True)
        for mode in ("load", "auto"):
            close(modes[mode])


def measure(modes: dict[str, LLMEngine], prompts: dict[str, list[int]],
            rng: random.Random) -> dict:  # fmt: skip
    out: dict = {"ttft": {}, "decisions": {}}
    auto = modes["auto"]

    def decisions() -> dict:
        st = auto.stats()
        return {"loads": st.kv_fetch_loads, "recomputes": st.kv_fetch_recomputes,
                "skipped": st.kv_fetch_skipped, "ties": st.kv_fetch_ties, "probes": auto.connector.policy.stats.probes}  # fmt: skip

    for kind, prompt in prompts.items():
        times: dict[str, list[float]] = {m: [] for m in modes}
        before = decisions()
        for _ in range(ARGS.repeats):
            for mode, eng in modes.items():
                times[mode].append(ttft(eng, prompt, rng))
        out["ttft"][kind] = {m: statistics.median(t) for m, t in times.items()}
        out.setdefault("runs", {})[kind] = {m: [round(x, 3) for x in t] for m, t in times.items()}
        out["decisions"][kind] = {k: v - before[k] for k, v in decisions().items()}
    pol = auto.connector.policy
    out["model"] = {"prefill_token_s": auto.costs.fit.prefill_token_s,
                    "load_2_blocks_s": pol.loads.predict(2 * pol.block_bytes),
                    "load_32_blocks_s": pol.loads.predict(32 * pol.block_bytes),
                    "samples": len(pol.loads._samples)}  # fmt: skip
    f = pol.stats
    out["predicted_s"], out["realized_s"] = f.predicted_load_seconds, f.realized_load_seconds
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--master")
    ap.add_argument("--host")
    ap.add_argument("--repeats", type=int, default=5)
    ARGS = ap.parse_args()
    main()
