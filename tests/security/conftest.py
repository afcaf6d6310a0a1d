"""A real `kvpool serve` cluster (the real model) for the hostile-input suite, started once open
(no token: loopback only) and once with a cluster token, exactly as `KVPOOL_AUTH_TOKEN=secret
make serve` starts it; every test runs against both and leaves the cluster serving."""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass, field

import httpx
import pytest
from support.procs import serve

from kvpool.common import auth

TOKEN = "security-suite-token-7f3a91"
HEADER_TIMEOUT = 3.0
FLAGS = ("--kv-cache-memory", "256MiB", "--store-memory", "256MiB", "--max-model-len", "4096",
         "--header-timeout", str(HEADER_TIMEOUT), "--log-level", "warning")  # fmt: skip


@dataclass
class Cluster:
    url: str
    token: str | None
    doc: dict = field(default_factory=dict)  # /cluster when it started

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def internal(self) -> dict:
        """What kvpool's own HTTP calls send (the directory, the conductor's relays)."""
        return {"Authorization": f"Bearer {auth.internal_bearer(self.token)}"} if self.token \
            else {}  # fmt: skip

    def process(self, name: str) -> dict:
        return self.doc["processes"][name]

    def workers(self, role: str | None = None) -> list[dict]:
        doc = httpx.get(f"{self.url}/cluster", headers=self.headers, timeout=10).json()
        return [w for w in doc["workers"] if role is None or w["role"] == role]

    def inflight(self, gauge: str = "inflight") -> float:
        """The conductor's requests admitted and not answered (``arriving``: not yet admitted)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        m = re.search(rf"^kvpool_conductor_{gauge}_requests (\S+)$", text, re.M)
        assert m, f"the conductor exports kvpool_conductor_{gauge}_requests"
        return float(m.group(1))

    def complete(self, prompt: str = "The capital of France is", max_tokens: int = 4):
        return httpx.post(f"{self.url}/v1/completions", headers=self.headers, timeout=120,
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})  # fmt: skip


def assert_alive(c: Cluster) -> None:
    """The service answers and still serves a real completion; every worker is routable."""
    assert httpx.get(f"{c.url}/health", timeout=10).status_code == 200
    r = c.complete()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    deadline = time.monotonic() + 10
    while not all(w["alive"] for w in c.workers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(w["alive"] for w in c.workers()), c.workers()


@pytest.fixture(scope="module", params=["open", "token"])
def cluster(request, tmp_path_factory):
    token = TOKEN if request.param == "token" else None
    log = tmp_path_factory.mktemp(f"security-{request.param}") / "serve.log"
    env = {auth.AUTH_ENV: token} if token else {}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    running = serve(log, *FLAGS, env=env, headers=headers)
    _, url = next(running)
    c = Cluster(url, token)
    c.doc = httpx.get(f"{url}/cluster", headers=c.headers, timeout=10).json()
    yield c
    assert_alive(c)  # whatever the tests did, it still serves
    next(running, None)


@pytest.fixture
def alive(cluster):
    """The cluster, checked alive after the test."""
    yield cluster
    assert_alive(cluster)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes ``sock`` within ``seconds`` (whatever it sends before)."""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


def http_status(sock: socket.socket, timeout: float = 30.0) -> int:
    """The status code of the HTTP response arriving on ``sock``."""
    sock.settimeout(timeout)
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    assert m, head[:200]
    return int(m.group(1))
