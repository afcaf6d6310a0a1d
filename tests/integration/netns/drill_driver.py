"""The client side of the drills, run inside a rig host (``rig.python``); prints JSON.

``put``/``get``: deterministic values through a ``StoreClient`` over TCP (hits, clean misses,
wrong bytes); ``writer``: puts until stdin closes, one ``ack`` line per acknowledged put;
``clear``: remove every object; ``calibrate``: this machine's prefill time; ``load``: completions with unique long prompts through the conductor, one record per
request; ``burst``: many requests at once (overload); ``cluster``: the conductor's /cluster.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import threading
import time

import httpx

from kvpool.common.errors import KVPoolError, NotFoundError
from kvpool.config import TransferConfig
from kvpool.store import StoreClient

WORDS = ["river", "stone", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "violet", "engine", "quartz", "willow"]  # fmt: skip


def value(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def client(master: str) -> StoreClient:
    return StoreClient(master, TransferConfig(transport="tcp"), timeout=5.0)


def cmd_put(a) -> dict:
    c = client(a.master)
    acked, failed = [], 0
    for i in range(a.count):
        key = f"{a.prefix}/{i}"
        try:
            c.put(key, value(key, a.size), a.replicas)
            acked.append(key)
        except KVPoolError:
            failed += 1
    placement = {k: [r.node for r in getattr(c.replicas(k), "replicas", ())]
                 for k in acked}  # fmt: skip
    c.close()
    return {"acked": acked, "failed": failed, "placement": placement}


def cmd_get(a) -> dict:
    c = client(a.master)
    hits = misses = wrong = 0
    missing: list[str] = []
    t0 = time.monotonic()
    for key in json.loads(a.keys):
        try:
            got = c.get(key)
        except NotFoundError:
            misses += 1
            missing.append(key)
            continue
        if got == value(key, a.size):
            hits += 1
        else:
            wrong += 1
    stats = c.stats()
    c.close()
    return {"hits": hits, "misses": misses, "wrong": wrong, "seconds": time.monotonic() - t0,
            "evictions": stats.get("evictions", 0), "stats": stats,
            "missing": missing[:20]}  # fmt: skip


def cmd_clear(a) -> dict:
    """Remove every object (the KV blocks earlier drills left), so a drill starts with room."""
    c = client(a.master)
    removed = c.remove_matching(None)
    stats = c.stats()
    c.close()
    return {
        "removed": removed,
        "objects_left": stats.get("objects"),
        "evictions": stats.get("evictions", 0),
        "dram_used": stats.get("dram_used_bytes"),
    }


def cmd_stats(a) -> dict:
    c = client(a.master)
    stats = c.stats()
    c.close()
    return stats


def cmd_writer(a) -> dict:
    """Put until stdin closes; an ``ack`` line (key, wall time) for each acknowledged put."""
    c = client(a.master)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    i, failed, slowest = 0, 0, 0.0
    while not stop.is_set():
        key = f"{a.prefix}/{i}"
        t0 = time.time()
        try:
            c.put(key, value(key, a.size))
            print(json.dumps({"ack": key, "t": time.time()}), flush=True)
        except KVPoolError:
            failed += 1
            time.sleep(0.02)
        slowest = max(slowest, time.time() - t0)
        i += 1
        time.sleep(a.gap)  # a steady stream, not a flood that fills the pool
    c.close()
    return {"attempts": i, "failed": failed, "slowest_put_s": slowest}


def prompt(tag: str, i: int) -> str:
    rng = random.Random(f"{tag}-{i}")
    body = " ".join(rng.choice(WORDS) for _ in range(220))
    return f"Request {tag}-{i}. Read these words and say which comes first: {body}"


def complete(
    http: httpx.Client, base: str, key: str, text: str, max_tokens: int, retries: int = 0
) -> dict:
    """One completion; a 429 is retried up to ``retries`` times after its Retry-After (at
    most 2 s), as a well-behaved client does. ``attempts`` counts the tries."""
    t0 = time.time()
    for attempt in range(1, retries + 2):
        try:
            r = http.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "SmolLM2-135M-Instruct", "prompt": text,
                                "max_tokens": max_tokens, "temperature": 0})  # fmt: skip
            body = r.json()
            status = r.status_code
        except httpx.HTTPError as exc:
            body, status = {"error": str(exc)}, -1
        if status != 429 or attempt > retries:
            break
        try:
            wait = float(r.headers.get("retry-after", "1"))
        except ValueError:
            wait = 1.0
        time.sleep(min(max(wait, 0.1), 2.0))
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"start": t0, "end": time.time(), "status": status, "cached": cached,
            "attempts": attempt, "text": (body.get("choices") or [{}])[0].get("text"),
            "error": body.get("error")}  # fmt: skip


def cmd_load(a) -> dict:
    """Requests with unique prompts, ``concurrency`` at a time, for ``duration`` s (each
    worker sends at least one, however late it starts on a busy machine)."""
    records: list[dict] = []
    lock = threading.Lock()
    end = time.time() + a.duration
    counter = iter(range(10_000))

    def worker():
        with httpx.Client(timeout=120) as http:
            sent = 0
            while not sent or time.time() < end:
                sent += 1
                with lock:
                    i = next(counter)
                rec = complete(http, a.base, a.api_key, prompt(a.tag, i), a.max_tokens, a.retries)
                with lock:
                    records.append(rec)

    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"records": records}


def cmd_burst(a) -> dict:
    """``n`` requests sent at once."""
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=a.n)) as http, \
            cf.ThreadPoolExecutor(a.n) as pool:  # fmt: skip
        futures = [pool.submit(complete, http, a.base, a.api_key, prompt(a.tag, i),
                               a.max_tokens) for i in range(a.n)]  # fmt: skip
        return {"records": [f.result() for f in futures]}


def cmd_calibrate(a) -> dict:
    """Seconds this machine takes to prefill one drill prompt on one thread (as the workers
    run): the drills' TTFT SLO is a multiple of it, so "normal load" means the same here as on
    a faster CPU."""
    import torch

    from kvpool import SamplingParams
    from kvpool.config import EngineConfig
    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.model.loader import load_model

    model = load_model(None, torch.float32)
    eng = LLMEngine(EngineConfig(kv_cache_memory_bytes="192MiB", num_threads=1), model)
    best = float("inf")
    for i in range(3):  # the first is a warm-up
        ids = model.tokenizer.encode(prompt("calibrate", i))
        t0 = time.perf_counter()
        eng.add_request(f"c{i}", ids, SamplingParams(temperature=0, max_tokens=1))
        while eng.has_work():
            eng.step()
        best = best if i == 0 else min(best, time.perf_counter() - t0)
    eng.close()
    return {"prefill_s": best, "prompt_tokens": len(ids)}


def cmd_cluster(a) -> dict:
    r = httpx.get(f"{a.base}/cluster", headers={"Authorization": f"Bearer {a.api_key}"},
                  timeout=10)  # fmt: skip
    return r.json()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("put", "get", "writer", "clear", "stats"):
        p = sub.add_parser(name)
        p.add_argument("--master", required=True)
        p.add_argument("--prefix", default="drill")
        p.add_argument("--size", type=int, default=64 << 10)
        p.add_argument("--count", type=int, default=50)
        p.add_argument("--replicas", type=int, default=None)
        p.add_argument("--keys", default="[]")
        p.add_argument("--gap", type=float, default=0.002, help="writer: seconds between puts")
    for name in ("load", "burst", "cluster"):
        p = sub.add_parser(name)
        p.add_argument("--base", required=True)
        p.add_argument("--api-key", default=os.environ.get("KVPOOL_API_KEY", ""))
        p.add_argument("--tag", default="t")
        p.add_argument("--n", type=int, default=10)
        p.add_argument("--concurrency", type=int, default=2)
        p.add_argument("--duration", type=float, default=30)
        p.add_argument("--max-tokens", type=int, default=8)
        p.add_argument("--retries", type=int, default=10, help="429 retries per request")
    sub.add_parser("calibrate")
    a = ap.parse_args()
    out = globals()[f"cmd_{a.cmd}"](a)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
