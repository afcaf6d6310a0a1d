"""Parts started separately (`kvpool store`, `kvpool worker`, `kvpool conductor`) find each
other through a real etcd: the multi-host deployment, on one machine."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest
from support.ports import free_port
from support.procs import Proc, kvpool_cmd, wait_healthy

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("secured", [False, True], ids=["open", "token"])
def test_parts_join_through_etcd(etcd, tmp_path, secured):
    """``secured``: every part reads the cluster token from one 0600 file (as on several
    hosts), and API clients hold a separate key, not the cluster token."""
    ep = etcd.endpoint
    url = f"etcd://{ep}"
    env, key = {}, "x"
    if secured:
        token_file = tmp_path / "token"
        token_file.write_text("etcd-cluster-token\n")
        token_file.chmod(0o600)
        env, key = {"KVPOOL_AUTH_TOKEN_FILE": str(token_file)}, "api-key-for-clients"
    auth = {"Authorization": f"Bearer {key}"}
    procs: list[Proc] = []
    conductor = None
    try:
        procs.append(Proc("store", "master", "--port", str(free_port()), "--etcd", ep,
                          "--log-level", "warning", env=env))  # fmt: skip
        procs.append(Proc("store", "node", "--master", url, "--memory", "256MiB",
                          "--directory", url, "--log-level", "warning", env=env))  # fmt: skip
        for role in ("prefill", "decode"):
            procs.append(Proc("worker", "--role", role, "--id", f"{role}-etcd", "--store", url,
                              "--etcd", ep, "--threads", "1", "--kv-cache-memory", "128MiB",
                              "--log-level", "warning", env=env))  # fmt: skip
        port = free_port()
        log = tmp_path / "conductor.log"
        with log.open("w") as out:
            conductor = subprocess.Popen([*kvpool_cmd(), "conductor", "--port", str(port),
                                          "--etcd", ep, "--store", url],
                                         stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **env, "KVPOOL_API_KEY": key})  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        wait_healthy(conductor, base, log)
        deadline = time.monotonic() + 20
        while len(httpx.get(f"{base}/cluster", headers=auth).json()["workers"]) < 2:
            assert time.monotonic() < deadline, "workers did not show up through etcd"
            time.sleep(0.2)
        if secured:  # the cluster token is not an API key
            wrong = {"Authorization": "Bearer etcd-cluster-token"}
            assert httpx.get(f"{base}/v1/models", headers=wrong).status_code == 401
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
        prompt = "Facts about the moon: it orbits the earth, it has craters, " * 6
        outs = [
            client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=prompt + q, max_tokens=4, temperature=0
            )
            for q in ("and", "so")
        ]
        assert outs[1].usage.prompt_tokens_details.cached_tokens >= 64
        doc = httpx.get(f"{base}/cluster", headers=auth).json()
        assert {w["id"] for w in doc["workers"]} == {"prefill-etcd", "decode-etcd"}
        assert doc["store"]["up"] and doc["store"]["nodes"] == 1
        decode = next(w for w in doc["workers"] if w["role"] == "decode")
        assert decode["counters"]["prefix_hits_pool"] > 0  # the hand-off went through the pool
        # a worker that stops leaves etcd, and the conductor forgets it
        procs[3].stop()
        deadline = time.monotonic() + 15
        while any(w["id"] == "decode-etcd"
                  for w in httpx.get(f"{base}/cluster", headers=auth).json()["workers"]):  # fmt: skip
            assert time.monotonic() < deadline, "the stopped worker is still listed"
            time.sleep(0.2)
    finally:
        if conductor is not None:
            conductor.send_signal(signal.SIGTERM)
            conductor.wait(30)
        for p in reversed(procs):
            p.stop()
