"""The simulator against reality (issue 16): the README's scaled trace slice replayed by
``kvpool bench replay`` against a real ``kvpool serve`` (started here, one policy after the
other), and simulated by ``kvpool sim`` on the same slice, the same cluster shape and policy,
with this machine's calibrated profile. Prints TTFT p50/p90, TBT p99 and the prefix hit rate
side by side with the simulator's relative error (the issue asks for 25 % or better).

  python benchmarks/bench_sim_validation.py [--policies cache_aware,random] [--prefill 2]
      [--decode 1] [--profile PATH] [--limit 100] [--json PATH] [--out DIR]

Without ``--profile`` it first runs ``kvpool sim calibrate`` (about a minute). It takes both
cores for several minutes (two servers started, two replays, the calibration): run it alone.
``--limit 8`` checks that it works end to end in about two minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CACHE, Results, log

from kvpool.bench.launch import MEASURE_FLAGS, Served

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data/traces/conversation_trace.jsonl"
# the README's replay slice (bench_replay.py's FULL), without --limit
SLICE = ["--block-tokens", "16", "--max-input", "384", "--max-output", "24", "--time-scale", "5"]
KEYS = {"ttft_p50": "median_ttft_s", "ttft_p90": "p90_ttft_s", "tbt_p99": "p99_tbt_s",
        "hit_rate": "prefix_hit_rate"}  # fmt: skip


def kvpool(*argv: str) -> None:
    cmd = [sys.executable, "-m", "kvpool.cli", *argv]
    log("$ kvpool " + " ".join(argv))
    subprocess.run(cmd, check=True)


def summary(folder: Path) -> dict:
    doc = json.loads((folder / "results.json").read_text())
    return next(iter(doc["systems"].values()))["summary"]


def compare(real: dict, sim: dict) -> dict[str, tuple[float | None, float | None, float | None]]:
    """Per figure: (real, simulated, relative error of the simulation)."""
    out = {}
    for name, key in KEYS.items():
        r, s = real.get(key), sim.get(key)
        err = (s - r) / r if r and s is not None else None
        out[name] = (r, s, err)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default="cache_aware,random")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--profile", default=None, help="a calibrated profile (default: calibrate)")
    ap.add_argument("--out", default=str(CACHE / "sim_validation"))
    ap.add_argument("--json", metavar="PATH", help="also write figures and ratios here")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = args.profile
    if profile is None:
        profile = str(out / "profile.json")
        kvpool("sim", "calibrate", "--out", profile)
    sliced = ["--trace", str(TRACE), "--limit", str(args.limit), *SLICE]
    shape = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    res = Results("bench_sim_validation", vars(args))
    worst = 0.0
    for policy in [p for p in args.policies.split(",") if p]:
        log(f"{policy}: kvpool serve {' '.join(shape)} --policy {policy}")
        served = Served([*shape, "--policy", policy, *MEASURE_FLAGS], out / f"serve-{policy}.log")
        try:
            kvpool("bench", "replay", *sliced, "--endpoint", served.url, "--no-progress",
                   "--out", str(out / f"real-{policy}"))  # fmt: skip
        finally:
            served.stop()
        kvpool("sim", *sliced, *shape, "--policy", policy, "--profile", profile,
               "--no-progress", "--out", str(out / f"sim-{policy}"))  # fmt: skip
        rows = compare(summary(out / f"real-{policy}"), summary(out / f"sim-{policy}"))
        for name, (r, s, err) in rows.items():
            if r is not None:
                res.figure(f"{policy}_real_{name}", r)
            if s is not None:
                res.figure(f"{policy}_sim_{name}", s)
            if r and s is not None:
                res.ratio(f"{policy}_sim_vs_real_{name}", s, r, higher_is_better=False)
                worst = max(worst, abs(err))
    print(f"\n{'policy':<12} {'figure':<10} {'real':>10} {'sim':>10} {'error':>8}")
    for key, v in res.figures.items():
        if "_real_" in key:
            policy, name = key.split("_real_")
            s = res.figures.get(f"{policy}_sim_{name}")
            err = f"{(s - v) / v:+.0%}" if v and s is not None else "-"
            shown = "-" if s is None else f"{s:.4g}"
            print(f"{policy:<12} {name:<10} {v:>10.4g} {shown:>10} {err:>8}")
    res.figure("worst_relative_error", worst)
    res.dump(args.json)


if __name__ == "__main__":
    main()
