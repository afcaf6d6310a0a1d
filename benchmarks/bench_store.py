"""Store vs store: kvpool's store, Mooncake Store and Redis under one workload, in one run.

Put and get of 4 KiB, 64 KiB, 1 MiB and 8 MiB values, single calls and batches (16 values a
batch for >= 1 MiB, 64 for smaller), always from a client process other than the one holding
the memory:

- kvpool: ``kvpool store master`` + one ``kvpool store node --memory 1GiB`` (the holder), an
  HTTP segment directory (``MetadataServer``, in this process); the client is ``StoreClient``
  with ``TransferConfig(transport="tcp")`` (``kvpool_tcp``: the like-for-like comparison) and
  again with ``transport="auto"`` (``kvpool_shm``: the same-host shared-memory path), both with
  the client's lease cache **off**: every get asks the master, as the peers' clients do (the
  headline ratios). ``kvpool_tcp_cached`` / ``kvpool_shm_cached``: the same with the lease
  cache on (repeated reads within a read lease skip the master; kvpool's own feature: its own
  rows and ``cached_*`` ratios, with the cache's hits and misses in the JSON). Single:
  ``put`` / ``get_into``; batched: ``batch_put`` / ``batch_get_into``. ``kvpool_mac``: a second
  such pool started with a cluster token, the client over TCP like ``kvpool_tcp``: every value
  carries a keyed BLAKE3 MAC instead of xxh3 (a feature of kvpool's: its own ratios,
  ``mac_*_vs_open_*``, never a peer's).
- Mooncake Store (``peers/mooncake_store_peer.py``, its own virtualenv): ``mooncake_master`` +
  a holder process with a 1 GiB global segment; the client mounts no segment (size 0), over
  TCP. Single: ``put_from`` / ``get_into``; batched: ``batch_put_from`` / ``batch_get_into``
  (registered buffer, zero-copy).
- Redis (``peers/redis_peer.py``): ``redis-server`` on loopback (no persistence), redis-py in
  its own virtualenv. Single: SET / GET; batched: MSET / MGET (one command per batch).

Each system's workload runs in a driver subprocess (``run_workload`` below, stdlib only, with
the system's adapter) that prints JSON figures; systems alternate within each of ``--rounds``
rounds and every figure is the median over rounds (ratios: the median of per-round ratios).
Per (system, op, size, mode): GB/s (1e9 B/s) and values/s over the time spent inside the store
calls, p50/p99 latency per call (single) or per batch (batched). Puts write unique keys (the
oldest half is removed, untimed, when the resident set reaches ``--resident`` bytes or 8192
keys, far below the 90% eviction mark of the 1 GiB pools); gets read the keys left resident;
a sample of gets is checked byte for byte; the first call of each measurement is an untimed
warm-up. ``--json PATH`` writes "figures" (``<system>_<op>_<single|batch>_<size>_<GBps|ops|
p50_us|p99_us>``, ops = values/s) and "ratios" (kvpool over TCP against a peer, e.g.
``get_vs_mooncake_1MiB``, ``batch_put_vs_redis_8MiB``, ``ops_vs_mooncake_4KiB`` = batched gets/s;
``shm_*``: the same-host path against Mooncake over TCP; ``cached_*``, ``cached_shm_*``: with
the lease cache; ``mac_*_vs_open_*``: the token pool against the open one) and figures
``<system>_lease_cache_hits`` / ``_misses``; ``--plot PATH`` draws GB/s per size.

    .venv/bin/python benchmarks/bench_store.py --quick
    .venv/bin/python benchmarks/bench_store.py --json docs/results/bench_store.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import re
import statistics
import struct
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
from common import CACHE, KvpoolProcs, Results, log  # noqa: E402  (stdlib only: drivers of any venv import us)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = {"4KiB": 4 * KiB, "64KiB": 64 * KiB, "1MiB": MiB, "8MiB": 8 * MiB}
MODES = ("single", "batch")
OPS = ("put", "get")
POOL_BYTES = GiB  # kvpool node memory and Mooncake's global segment
WARM_BYTES = 768 * MiB  # touched once before timing (both pools allocate their pages lazily)
MAX_RESIDENT_KEYS = 8192
LOGS = CACHE / "store-logs"
SYSTEMS = ("kvpool_tcp", "kvpool_shm", "kvpool_tcp_cached", "kvpool_shm_cached", "kvpool_mac",
           "mooncake", "redis")  # fmt: skip
KVPOOL_SYSTEMS = {  # system -> (transport, client lease cache)
    "kvpool_tcp": ("tcp", False),
    "kvpool_shm": ("auto", False),
    "kvpool_tcp_cached": ("tcp", True),
    "kvpool_shm_cached": ("auto", True),
}
MAC_TOKEN, MAC_ADMIN = "bench-store-cluster-token", "bench-store-admin-token"
_TOKEN_VARS = ("KVPOOL_AUTH_TOKEN", "KVPOOL_AUTH_TOKEN_FILE", "KVPOOL_ADMIN_TOKEN",
               "KVPOOL_ADMIN_TOKEN_FILE")  # fmt: skip


def pool_env(token: str | None) -> dict:
    """The environment of a pool's processes and drivers: ``token`` (with the admin token, for
    the benchmark's removes), or none at all whatever the caller's shell has."""
    env = {k: v for k, v in os.environ.items() if k not in _TOKEN_VARS}
    if token:
        env.update(KVPOOL_AUTH_TOKEN=token, KVPOOL_ADMIN_TOKEN=MAC_ADMIN)
    return env


def batch_for(size: int) -> int:
    """Values per batch: 16 for values of 1 MiB and more, 64 for smaller ones."""
    return 16 if size >= MiB else 64


# -- the workload (stdlib only: it runs under the kvpool, Mooncake and Redis pythons) -------


def _stats(lat: list[float], values: int, size: int) -> dict:
    active = sum(lat) or 1e-9
    s = sorted(lat)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))] * 1e6

    return {
        "GBps": round(values * size / active / 1e9, 4),
        "ops": round(values / active, 1),
        "p50_us": round(pct(0.50), 1),
        "p99_us": round(pct(0.99), 1),
        "calls": len(lat),
        "values": values,
    }


class _Cell:
    """One (size, mode) cell: key names, source/destination offsets, stamps, verification."""

    def __init__(self, store, buf: memoryview, region: int, prefix: str, label: str, mode: str):
        self.store, self.buf, self.region = store, buf, region
        self.size = SIZES[label]
        self.slots = batch_for(self.size)
        self.batch = 1 if mode == "single" else self.slots
        self.prefix = f"{prefix}/{label}/{mode}/"
        self.checked = 0

    def key(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def src(self, i: int) -> int:
        """Source offset of key ``i``, stamped with ``i`` (values differ key by key)."""
        off = (i % self.slots) * self.size
        self.buf[off : off + 8] = struct.pack("<Q", i)
        return off

    def dst(self, j: int) -> int:
        return self.region + (j % self.slots) * self.size

    def verify(self, i: int, got) -> None:
        off = (i % self.slots) * self.size
        good = (
            got is not None
            and len(got) == self.size
            and bytes(got[:8]) == struct.pack("<Q", i)
            and bytes(got[8:]) == bytes(self.buf[off + 8 : off + self.size])
        )
        if not good:
            raise RuntimeError(f"get of {self.key(i)} returned other bytes than were put")
        self.checked += 1


def _time_loop(step, seconds: float, max_values: int, batch: int) -> list[float]:
    """One untimed ``step(0)`` (warm-up: connections, first touch), then ``step(1)``,
    ``step(2)``... (each returns its own timed seconds) until ``seconds`` of store time, or
    ``max_values`` values, or a wall-clock cap; at least 3 timed calls unless the cap is hit."""
    step(0)
    lat: list[float] = []
    wall_cap = time.monotonic() + 5 * seconds + 10
    active, values, n = 0.0, 0, 1
    while True:
        dt = step(n)
        lat.append(dt)
        active += dt
        values += batch
        n += 1
        if time.monotonic() > wall_cap:
            break
        if len(lat) >= 3 and (active >= seconds or values + batch > max_values):
            break
    return lat


def _put_phase(cell: _Cell, seconds: float, max_values: int, resident_bytes: int):
    s, b, size = cell.store, cell.batch, cell.size
    cap = max(cell.slots, min(resident_bytes // size, MAX_RESIDENT_KEYS) // cell.slots * cell.slots)
    resident: list[int] = []

    def step(n: int) -> float:
        if len(resident) + b > cap:  # untimed: keep the pool far from its eviction mark
            drop = len(resident) // 2
            s.remove([cell.key(i) for i in resident[:drop]])
            del resident[:drop]
        first = n * b
        ids = list(range(first, first + b))
        keys = [cell.key(i) for i in ids]
        offs = [cell.src(i) for i in ids]
        t0 = time.perf_counter()
        if b == 1:
            s.put(keys[0], offs[0], size)
        else:
            s.batch_put(keys, offs, size)
        dt = time.perf_counter() - t0
        resident.extend(ids)
        return dt

    lat = _time_loop(step, seconds, max_values, b)
    return lat, resident


def _get_phase(cell: _Cell, resident: list[int], seconds: float, max_values: int):
    s, b, size = cell.store, cell.batch, cell.size
    groups = max(1, len(resident) // b)

    def step(n: int) -> float:
        g = n % groups
        ids = resident[g * b : g * b + b]
        keys = [cell.key(i) for i in ids]
        offs = [cell.dst(j) for j in range(len(ids))]
        t0 = time.perf_counter()
        got = [s.get(keys[0], offs[0], size)] if b == 1 else s.batch_get(keys, offs, size)
        dt = time.perf_counter() - t0
        if n < 2 or n % 16 == 0:  # untimed: byte-exact check of a sample
            cell.verify(ids[0], got[0])
            cell.verify(ids[-1], got[-1])
        return dt

    return _time_loop(step, seconds, max_values, b)


def run_workload(store, cfg: dict) -> dict:
    """Run every (size, mode) cell against ``store`` (an adapter: ``alloc``, ``put``, ``get``,
    ``batch_put``, ``batch_get``, ``remove``); returns {"cells": {...}, "verified": n}."""
    labels = cfg["sizes"]
    seconds = float(cfg["seconds"])
    max_values = int(cfg["max_ops"])
    resident_bytes = int(cfg["resident_bytes"])
    region = max(batch_for(SIZES[lab]) * SIZES[lab] for lab in labels)
    buf = store.alloc(2 * region)  # [sources | destinations]
    for off in range(0, region, 8 * MiB):
        n = min(8 * MiB, region - off)
        buf[off : off + n] = os.urandom(n)
    cells: dict[str, dict] = {}
    verified = 0
    for label in labels:
        for mode in MODES:
            cell = _Cell(store, buf, region, cfg["prefix"], label, mode)
            t0 = time.monotonic()
            lat, resident = _put_phase(cell, seconds, max_values, resident_bytes)
            cells[f"put_{mode}_{label}"] = _stats(lat, len(lat) * cell.batch, cell.size)
            lat = _get_phase(cell, resident, seconds, max_values)
            cells[f"get_{mode}_{label}"] = _stats(lat, len(lat) * cell.batch, cell.size)
            store.remove([cell.key(i) for i in resident])
            verified += cell.checked
            print(
                f"  {label} {mode}: put {cells[f'put_{mode}_{label}']['GBps']:.3g} GB/s, "
                f"get {cells[f'get_{mode}_{label}']['GBps']:.3g} GB/s "
                f"({time.monotonic() - t0:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    return {"cells": cells, "verified": verified}


def alloc_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Page-aligned anonymous memory, touched."""
    mm = mmap.mmap(-1, nbytes)
    view = memoryview(mm)
    for off in range(0, nbytes, 4096):
        view[off] = 0
    return mm, view


# -- kvpool: driver adapter and processes ---------------------------------------------------


class KvpoolStore:
    """The workload's adapter for kvpool's ``StoreClient``."""

    def __init__(self, master: str, directory: str, transport: str, lease_cache: bool) -> None:
        from kvpool.common import auth
        from kvpool.config import TransferConfig
        from kvpool.store import StoreClient

        self.client = StoreClient(master, TransferConfig(directory=directory, transport=transport),
                                  lease_cache=lease_cache, admin_token=auth.admin_token())  # fmt: skip
        self.mv: memoryview | None = None

    def alloc(self, nbytes: int) -> memoryview:
        self._mm, self.mv = alloc_buffer(nbytes)
        return self.mv

    def put(self, key: str, off: int, size: int) -> None:
        self.client.put(key, self.mv[off : off + size])

    def get(self, key: str, off: int, size: int):
        n = self.client.get_into(key, self.mv[off : off + size])
        return self.mv[off : off + n]

    def batch_put(self, keys: list[str], offs: list[int], size: int) -> None:
        errors = self.client.batch_put(keys, [self.mv[o : o + size] for o in offs])
        bad = [(k, e) for k, e in zip(keys, errors, strict=True) if e is not None]
        if bad:
            raise RuntimeError(f"batch_put: {len(bad)} failed, first {bad[0][0]}: {bad[0][1]}")

    def batch_get(self, keys: list[str], offs: list[int], size: int) -> list:
        sizes = self.client.batch_get_into(keys, [self.mv[o : o + size] for o in offs])
        return [self.mv[o : o + n] if n >= 0 else None for o, n in zip(offs, sizes, strict=True)]

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.client.remove(k, force=True)

    def close(self) -> None:
        self.client.close()
        self.mv = None


def kvpool_driver(cfg: dict) -> dict:
    store = KvpoolStore(cfg["master"], cfg["directory"], cfg["transport"],
                        cfg.get("lease_cache", False))  # fmt: skip
    try:
        out = run_workload(store, cfg)
        leases = store.client.leases
        out["lease_cache"] = {"enabled": leases.enabled, "hits": leases.hits,
                              "misses": leases.misses}  # fmt: skip
    finally:
        store.close()
    return out


class KvpoolPool:
    """An HTTP segment directory (here), ``kvpool store master`` and one storage node; with
    ``token``, all of them (and the drivers, ``env``) hold it."""

    def __init__(self, token: str | None = None) -> None:
        from kvpool.transfer.metadata_server import MetadataServer

        self.token, self.env = token, pool_env(token)
        self.tag = "mac-" if token else ""
        self.procs = KvpoolProcs(LOGS, self.env)
        self.meta = MetadataServer(token=token or "")
        self.directory = self.meta.url
        try:
            master = self._start("master", "store", "master", "--port", "0")
            self.master = master["address"].replace("tcp://", "")
            self._start(
                "node",
                *("store", "node", "--master", self.master, "--memory", str(POOL_BYTES)),
                *("--node-id", f"bench-{self.tag}holder", "--directory", self.directory),
            )
            self._warm()
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, *argv: str) -> dict:
        return self.procs.start(f"kvpool-{self.tag}{name}", *argv)

    def _warm(self) -> None:
        from kvpool.config import TransferConfig
        from kvpool.store import StoreClient

        block = bytes(32 * MiB)
        keys = [f"warm/{i}" for i in range(WARM_BYTES // len(block))]
        config = TransferConfig(directory=self.directory, auth_token=self.token or "")
        with StoreClient(self.master, config, token=self.token or "",
                         admin_token=MAC_ADMIN if self.token else None) as c:  # fmt: skip
            for k in keys:
                c.put(k, block)
            for k in keys:
                c.remove(k, force=True)

    def driver_cmd(self, transport: str, lease_cache: bool, cfg: dict) -> list[str]:
        cfg = {**cfg, "master": self.master, "directory": self.directory, "transport": transport,
               "lease_cache": lease_cache}  # fmt: skip
        return [sys.executable, str(Path(__file__).resolve()), "--driver", json.dumps(cfg)]

    def close(self) -> None:
        self.procs.close()
        self.meta.close()


# -- main -------------------------------------------------------------------------------------


def run_driver(name: str, cmd: list[str], env: dict | None, timeout: float) -> dict | None:
    """Run one driver process; its last stdout line is its JSON. None (logged) on failure."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n[timed out after {timeout:.0f} s]"
    (LOGS / f"driver-{name}.log").write_text(err)
    if proc.returncode != 0 or not out.strip():
        lines = [ln for ln in err.strip().splitlines() if not re.match(r"[IW]\d{4} ", ln)]
        tail = "\n    ".join(lines[-6:])  # without glog's info/warning lines
        log(f"{name}: driver failed (exit {proc.returncode}):\n    {tail}")
        return None
    res = json.loads(out.strip().splitlines()[-1])
    log(f"{name}: done in {time.monotonic() - t0:.1f} s ({res.get('verified', 0)} gets verified)")
    return res


def headline(cells: dict) -> str:
    parts = []
    for key in ("get_single_1MiB", "put_single_1MiB", "get_batch_4KiB"):
        c = cells.get(key)
        if c:
            parts.append(f"{key} {c['GBps']:.3g} GB/s {c['ops']:.0f}/s")
    return ", ".join(parts)


def aggregate(res: Results, rounds: list[dict[str, dict]], labels: list[str]) -> None:
    """Figures: medians over rounds. Ratios: medians of the per-round ratios."""
    for system in SYSTEMS:
        for op in OPS:
            for mode in MODES:
                for label in labels:
                    cell = f"{op}_{mode}_{label}"
                    got = [r[system]["cells"][cell] for r in rounds if system in r]
                    for metric in ("GBps", "ops", "p50_us", "p99_us"):
                        if got:
                            value = statistics.median(g[metric] for g in got)
                            res.figures[f"{system}_{cell}_{metric}"] = round(float(value), 4)

    def ratio(name: str, ours: str, theirs: str, cell: str, metric: str = "GBps") -> None:
        vals = [
            r[ours]["cells"][cell][metric] / r[theirs]["cells"][cell][metric]
            for r in rounds
            if ours in r and theirs in r and r[theirs]["cells"][cell][metric] > 0
        ]
        if vals:
            res.ratios[name] = round(statistics.median(vals), 3)

    for peer in ("mooncake", "redis"):
        for op in OPS:
            for label in labels:
                ratio(f"{op}_vs_{peer}_{label}", "kvpool_tcp", peer, f"{op}_single_{label}")
                ratio(f"batch_{op}_vs_{peer}_{label}", "kvpool_tcp", peer, f"{op}_batch_{label}")
        if "4KiB" in labels:
            ratio(f"ops_vs_{peer}_4KiB", "kvpool_tcp", peer, "get_batch_4KiB", "ops")
    for op in OPS:
        for label in labels:
            ratio(f"mac_{op}_vs_open_{label}", "kvpool_mac", "kvpool_tcp", f"{op}_single_{label}")
            ratio(f"mac_batch_{op}_vs_open_{label}", "kvpool_mac", "kvpool_tcp",
                  f"{op}_batch_{label}")  # fmt: skip
            ratio(f"shm_{op}_vs_mooncake_{label}", "kvpool_shm", "mooncake", f"{op}_single_{label}")
            # the client's lease cache, kvpool's own feature: its own rows, never the headline
            ratio(f"cached_{op}_vs_mooncake_{label}", "kvpool_tcp_cached", "mooncake",
                  f"{op}_single_{label}")  # fmt: skip
            ratio(f"cached_shm_{op}_vs_mooncake_{label}", "kvpool_shm_cached", "mooncake",
                  f"{op}_single_{label}")  # fmt: skip
            ratio(
                f"shm_batch_{op}_vs_mooncake_{label}",
                "kvpool_shm",
                "mooncake",
                f"{op}_batch_{label}",
            )


def print_table(res: Results, labels: list[str], present: list[str]) -> None:
    f = res.figures
    print(f"\n== {res.name}  (GB/s | values/s | p50 / p99 us; batched: per batch of 16 or 64)")
    head = "  ".join(f"{s:>30}" for s in present)
    print(f"  {'op mode size':<20}  {head}")
    for op in OPS:
        for mode in MODES:
            for label in labels:
                cell = f"{op}_{mode}_{label}"
                row = []
                for s in present:
                    k = f"{s}_{cell}_"
                    if k + "GBps" in f:
                        row.append(
                            f"{f[k + 'GBps']:6.3f} {f[k + 'ops']:8.0f} "
                            f"{f[k + 'p50_us']:6.0f}/{f[k + 'p99_us']:<6.0f}"
                        )
                    else:
                        row.append("-")
                print(
                    f"  {op + ' ' + mode + ' ' + label:<20}  " + "  ".join(f"{x:>30}" for x in row)
                )
    print("  ratios (kvpool over TCP / peer; shm_: same-host path / Mooncake TCP; mac_: the "
          "token pool / the open one):")  # fmt: skip
    for k, v in res.ratios.items():
        print(f"  {k:<32} {v:>8.2f}x")


def write_json(res: Results, path: str) -> None:
    doc = {
        "benchmark": res.name,
        "args": res.args,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "figures": res.figures,
        "ratios": res.ratios,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    log(f"wrote {path}")


def plot(res: Results, labels: list[str], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    names = {
        "kvpool_tcp": "kvpool (TCP)",
        "kvpool_shm": "kvpool (same-host shm)",
        "kvpool_tcp_cached": "kvpool (TCP, lease cache)",
        "kvpool_shm_cached": "kvpool (shm, lease cache)",
        "kvpool_mac": "kvpool (TCP, token: MACs)",
        "mooncake": "Mooncake Store (TCP)",
        "redis": "Redis (TCP)",
    }
    width = 0.8 / len(SYSTEMS)
    for ax, (op, mode) in zip(axes.flat, [(o, m) for o in OPS for m in MODES], strict=True):
        for i, system in enumerate(SYSTEMS):
            vals = [res.figures.get(f"{system}_{op}_{mode}_{lab}_GBps", 0.0) for lab in labels]
            xs = [x + (i - (len(SYSTEMS) - 1) / 2) * width for x in range(len(labels))]
            ax.bar(xs, vals, width, label=names[system])
        what = "single calls" if mode == "single" else "batches of 64 (<1 MiB) / 16 (>=1 MiB)"
        ax.set_title(f"{op}: {what}", fontsize=10)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel("GB/s (log scale)")
        ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("KV stores, client in another process (2-core CPU host; higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short measurements (under 5 minutes)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (median reported)")
    ap.add_argument("--seconds", type=float, default=None, help="store time per measurement")
    ap.add_argument("--max-ops", type=int, default=None, help="values per measurement, at most")
    ap.add_argument("--sizes", default=",".join(SIZES), help="subset of " + ",".join(SIZES))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="subset of " + ",".join(SYSTEMS))
    ap.add_argument("--resident", default="384MiB", help="resident bytes per measurement, at most")
    ap.add_argument("--json", default=None, help="write figures and ratios here")
    ap.add_argument("--plot", default=None, help="draw a PNG here")
    ap.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.driver is not None:
        print(json.dumps(kvpool_driver(json.loads(args.driver))), flush=True)
        return

    from kvpool.config import parse_size

    started = time.monotonic()
    rounds_n = args.rounds or (3 if args.quick else 5)
    seconds = args.seconds or (0.25 if args.quick else 1.0)
    max_ops = args.max_ops or (3000 if args.quick else 20000)
    labels = [s for s in args.sizes.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    for name, allowed in ((labels, SIZES), (systems, SYSTEMS)):
        if bad := [x for x in name if x not in allowed]:
            ap.error(f"unknown {bad}; choose from {list(allowed)}")
    resident = parse_size(args.resident)
    if resident > 0.6 * POOL_BYTES:
        ap.error("--resident must stay below 60% of the 1 GiB pools")
    cfg = {
        "sizes": labels,
        "seconds": seconds,
        "max_ops": max_ops,
        "resident_bytes": resident,
    }
    res = Results("bench_store", vars(args).copy())
    res.args.update(
        rounds=rounds_n,
        seconds=seconds,
        max_ops=max_ops,
        resident_bytes=resident,
        pool_bytes=POOL_BYTES,
        batch={"<1MiB": 64, ">=1MiB": 16},
        metrics="GB/s and values/s over time inside store calls; p50/p99 per call or batch",
        kvpool_single="put / get_into",
        kvpool_batch="batch_put / batch_get_into",
    )
    del res.args["driver"]
    # per driver: 4 phases a size, each at most ~5 x seconds + 10 s, plus start-up
    timeout = 120 + len(labels) * 4 * (5 * seconds + 10)

    import mooncake_store_peer as mc
    import redis_peer as rd

    pool = mac = moon = red = None
    runners: dict[str, tuple] = {}  # system -> (cfg -> driver argv, env)
    try:
        if set(KVPOOL_SYSTEMS) & set(systems):
            log("kvpool: starting the segment directory, master and a 1 GiB node")
            pool = KvpoolPool()
            log(f"kvpool: master {pool.master}, directory {pool.directory}; pool warmed")
            for system, (transport, cached) in KVPOOL_SYSTEMS.items():
                if system in systems:
                    runners[system] = (partial(pool.driver_cmd, transport, cached), pool.env)
        if "kvpool_mac" in systems:
            log("kvpool: starting a second pool with a cluster token (keyed MACs)")
            mac = KvpoolPool(MAC_TOKEN)
            runners["kvpool_mac"] = (partial(mac.driver_cmd, "tcp", False), mac.env)
        if "mooncake" in systems:
            moon = mc.MooncakeStorePool.start(POOL_BYTES, WARM_BYTES, LOGS)
            if moon is None:
                log(f"mooncake: SKIPPED: {mc.last_error}")
                res.args["mooncake_skipped"] = mc.last_error
            else:
                res.args.update(moon.info)
                runners["mooncake"] = (moon.driver_cmd, moon.env)
        if "redis" in systems:
            red = rd.RedisServer.start(LOGS)
            if red is None:
                log(f"redis: SKIPPED: {rd.last_error}")
                res.args["redis_skipped"] = rd.last_error
            else:
                res.args.update(red.info)
                runners["redis"] = (red.driver_cmd, red.env)

        order = [s for s in SYSTEMS if s in runners]
        rounds: list[dict[str, dict]] = []
        for r in range(rounds_n):
            got: dict[str, dict] = {}
            k = r % max(1, len(order))  # rotate who goes first
            for system in order[k:] + order[:k]:
                log(f"round {r + 1}/{rounds_n}: {system}")
                make_cmd, env = runners[system]
                cmd = make_cmd({**cfg, "prefix": f"bench/r{r}/{system}"})
                out = run_driver(system, cmd, env, timeout)
                if out is not None:
                    got[system] = out
                    if "lease_cache" in out:
                        hits = res.args.setdefault("lease_cache_hits", {})
                        hits.setdefault(system, []).append(out["lease_cache"])
                    log(f"  {headline(out['cells'])}")
                    if system == "redis":
                        res.args.update(out.get("info", {}))
            rounds.append(got)
    finally:
        for server in (red, moon, mac, pool):
            if server is not None:
                server.close()

    present = [s for s in SYSTEMS if any(s in r for r in rounds)]
    aggregate(res, rounds, labels)
    for system, per_round in res.args.get("lease_cache_hits", {}).items():
        res.figures[f"{system}_lease_cache_hits"] = sum(r["hits"] for r in per_round)
        res.figures[f"{system}_lease_cache_misses"] = sum(r["misses"] for r in per_round)
    res.args["systems_measured"] = present
    res.args["run_seconds"] = round(time.monotonic() - started, 1)
    print_table(res, labels, present)
    for key in (
        "get_vs_mooncake_1MiB",
        "put_vs_mooncake_1MiB",
        "get_vs_redis_1MiB",
        "ops_vs_mooncake_4KiB",
        "shm_get_vs_mooncake_1MiB",
        "cached_get_vs_mooncake_1MiB",
        "cached_shm_get_vs_mooncake_1MiB",
        "mac_get_vs_open_1MiB",
        "mac_put_vs_open_1MiB",
    ):
        if key in res.ratios:
            log(f"{key} = {res.ratios[key]:.2f}x")
    if args.json:
        write_json(res, args.json)
    if args.plot or args.json:
        plot(res, labels, args.plot or str(Path(args.json).with_suffix(".png")))
    log(f"bench_store: {res.args['run_seconds']:.0f} s")


if __name__ == "__main__":
    main()
