"""Real services for tests: free ports and an etcd server (started and always stopped)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

_handed_out: set[int] = set()


def free_port() -> int:
    """A free 127.0.0.1 port *below* the ephemeral range: a port the kernel picked for us
    (bind to 0) can be picked again for any process's ``bind(0)`` before our server binds it
    (a transfer server took a conductor's port that way, and the suite's health checks hit
    it); ports the kernel never hands out by itself cannot be taken like that."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32000)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")


class EtcdProcess:
    """A single-member etcd on free 127.0.0.1 ports, data in ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(binary):
            pytest.fail("etcd is not installed: `make test` installs Debian's etcd-server")
        self.port = free_port()
        peer = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = open(data_dir / "etcd.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                binary,
                "--name=kvpool-test",
                f"--data-dir={data_dir / 'data'}",
                f"--listen-client-urls=http://{self.endpoint}",
                f"--advertise-client-urls=http://{self.endpoint}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=kvpool-test=http://127.0.0.1:{peer}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_healthy(20.0)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        pytest.fail(f"etcd did not become healthy; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
