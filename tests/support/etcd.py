"""A real etcd server for tests (started and always stopped)."""

from __future__ import annotations

import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from support.ports import free_port
from support.process import Process


class EtcdProcess(Process):
    """A single-member etcd on free 127.0.0.1 ports, data in ``data_dir``, its output in
    ``data_dir / "etcd.log"``."""

    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(binary):
            pytest.fail("etcd is not installed: `make test` installs Debian's etcd-server")
        self.port = free_port()
        peer = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        super().__init__(
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
            log=data_dir / "etcd.log",
            name="etcd",
        )
        self._wait_healthy(20.0)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                break
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        pytest.fail(f"etcd did not become healthy; see {self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int | None:
        return super().stop(sig, timeout)
