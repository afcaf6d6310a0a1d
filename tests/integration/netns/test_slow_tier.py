"""Fetch only when it pays, across a slow link: the pool on a store host whose link to the
decode host is shaped (``tc`` token bucket) to four times the rate at which a 512-token
prefix (24 MB) loads as fast as this machine computes it, or to 2.5 times below it, where no
prefix loads faster (the break-even rate is measured first: about 27 MB/s on an AVX-512
Xeon, 6 MB/s on a Zen 1 EPYC, with the link not yet shaped). The policy's time to first
token is never more than 10 % worse than the better of always loading and always recomputing,
for a short (2 blocks) and a long (32 blocks) prefix the pool holds. This kernel has no
``netem``, so the link has bandwidth but no added latency: the split by length that a fixed
per-load cost causes (short recomputed, long loaded) is shown in tests/engine/test_fetch_policy.py
with a modelled latency. Needs root (CI has it) and the real model."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rig as rigmod

pytestmark = pytest.mark.slow
if rigmod.available():
    pytestmark = [pytest.mark.slow, pytest.mark.skip(reason=rigmod.available())]

DRIVER = Path(__file__).with_name("slow_tier_driver.py")
FACTORS = {"fast": 4.0, "slow": 1 / 2.5}  # link rate over the break-even rate
REPEATS = 3


def run_driver(tmp_path: Path) -> dict:
    """The driver's figures for each link rate in ``FACTORS``: one engine process, one pool,
    the link shaped after the pool holds the prefixes and the machine's break-even rate (the
    bytes per second at which loading the long prefix takes as long as recomputing it) is
    measured."""
    rig = rigmod.Rig({"store": ["data"], "decode": ["data"]}, tmp_path)
    try:
        token = tmp_path / "token"
        token.write_text("slow-tier-token\n")
        token.chmod(0o600)
        env = {"KVPOOL_AUTH_TOKEN_FILE": str(token)}
        store, decode = rig.hosts["store"].addr(), rig.hosts["decode"].addr()
        rig.kvpool("store", "store", "master", "--host", store, "--port", "7000",
                   "--log-level", "warning", name="master", env=env)  # fmt: skip
        time.sleep(0.5)
        rig.kvpool("store", "store", "node", "--host", store, "--master", f"{store}:7000",
                   "--memory", "512MiB", "--node-id", "slow", "--log-level", "warning",
                   name="node", env=env)  # fmt: skip
        driver = rig.python("decode", DRIVER, "--master", f"{store}:7000", "--host", decode,
                            "--repeats", str(REPEATS), name="driver", env=env, stdin=True)  # fmt: skip
        cal = json.loads(driver.readline(600))
        break_even = cal["bytes"] / cal["recompute_s"]
        print(f"SLOW TIER calibration: {cal}", flush=True)
        out = {}
        for link, factor in FACTORS.items():
            rate = f"{max(1, round(break_even * factor * 8 / 1e6))}mbit"
            rig.throttle("store", rate)
            out[link] = json.loads(driver.cmd(f"measure {link}", timeout=600))
            print(f"SLOW TIER ({link}, {rate}): {out[link]}", flush=True)
        driver.stop(None, timeout=30)
    finally:
        rig.close()
    return out


def test_policy_picks_the_faster_of_load_and_recompute(tmp_path):
    for link, out in run_driver(tmp_path).items():
        t, d = out["ttft"], out["decisions"]
        long, short = t["long"], t["short"]
        for kind in ("short", "long"):  # every repeat decided (none was a local hit)
            assert sum(d[kind][k] for k in ("loads", "recomputes", "skipped")) == REPEATS, out
        if link == "fast":
            assert long["load"] < long["recompute"], out  # the link pays for a long prefix...
            assert d["long"]["loads"] >= 2 and d["long"]["recomputes"] == 0, out  # ...it loads
        else:
            assert long["recompute"] < long["load"] and short["recompute"] < short["load"], out
            assert d["long"]["loads"] == 0, out  # computes every long prefix
            # A short prefix's two costs can be close on this link: on the AMX Xeon of
            # 2026-12-07, 2 blocks recomputed in 0.117 s and loaded in 0.138-0.153 s, within or
            # near the policy's tie band (fetch_policy.CLOSE), and its load model still held the
            # fast link's loads of the phase before. It loaded one of three repeats (a tie
            # explored) in one run and all three in another; what the issue asks of it, the
            # time bound below, held in both. So only the time is asserted for short prefixes.
        assert long["auto"] <= 1.10 * min(long["load"], long["recompute"]), (link, long)
        # a short prompt's first token comes within a step or two either way: the same bound,
        # plus 30 ms of step quantization
        assert short["auto"] <= 1.10 * min(short["load"], short["recompute"]) + 0.03, (link, short)
