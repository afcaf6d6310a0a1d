"""``kvpool transfer metadata`` and ``kvpool transfer peer`` as real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import numpy as np

from kvpool.entrypoints.transfer import pattern


def start(*argv: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "transfer", *argv],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return proc, json.loads(proc.stdout.readline())


def test_metadata_service_and_peer_with_metrics(engine_factory):
    from support.ports import free_port

    meta, info = start("metadata", "--port", str(free_port()))
    mport = free_port()
    peer, _ = start("peer", "--segment", "cli/kv", "--size", "1MiB", "--directory",
                        info["url"], "--metrics-port", str(mport))  # fmt: skip
    try:
        with urllib.request.urlopen(info["url"] + "/v1/segments", timeout=5) as r:
            names = [d["name"] for d in json.loads(r.read())["segments"]]
        assert names == ["cli/kv"]
        peer.stdin.write("fill 9\n")
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == "ok"
        te = engine_factory(directory=info["url"], transport="tcp")
        buf = np.zeros(100, np.uint8)
        te.read(buf, "cli/kv", 500)
        assert np.array_equal(buf, pattern(9, 1 << 20)[500:600])
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'kvpool_transfer_served_bytes_total{direction="read"} 100.0' in text
        peer.stdin.write("digest 0 99999999\n")
        peer.stdin.flush()
        assert peer.stdout.readline().startswith("error")
    finally:
        peer.stdin.close()  # the peer stops when its stdin closes
        assert peer.wait(10) == 0
        meta.send_signal(signal.SIGTERM)
        assert meta.wait(10) == 0
        for p in (peer, meta):
            p.stdout.close()
