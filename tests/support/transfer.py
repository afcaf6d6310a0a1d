"""What the transfer tests share: a real peer process (``kvpool transfer peer``) driven from
tests, and the fixtures (a metadata service, engines and peers that are always closed)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from kvpool.config import TransferConfig
from kvpool.transfer import TransferEngine
from kvpool.transfer.metadata_server import MetadataServer
from support.process import Process

PEER_STARTUP_TIMEOUT = 120.0


class PeerProcess(Process):
    """Registers ``segment`` of ``size`` bytes in another process; ``cmd`` talks to it."""

    def __init__(self, segment: str, size: int, directory: str, *extra: str) -> None:
        self.segment = segment
        self.size = size
        argv = [
            sys.executable, "-m", "kvpool.cli", "transfer", "peer",
            "--segment", segment, "--size", str(size), "--directory", directory, *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        super().__init__(argv, pipe_stdout=True, stdin=subprocess.PIPE, env=env,
                         ready=PEER_STARTUP_TIMEOUT, name=f"peer {segment}")  # fmt: skip
        self.port = self.info["port"]

    def fill(self, seed: int) -> None:
        assert self.cmd(f"fill {seed}") == "ok"

    def digest(self, offset: int, length: int) -> str:
        return self.cmd(f"digest {offset} {length}")

    def stop(self, sig: int | None = None, timeout: float = 10) -> int | None:
        """``quit`` on its stdin (then end of input); SIGKILL after ``timeout`` s."""
        if sig is None and self.running():
            self.resume()
            with contextlib.suppress(OSError, ValueError):
                self.send("quit")
        return super().stop(sig, timeout)


@pytest.fixture
def metadata():
    server = MetadataServer()
    yield server
    server.close()


@pytest.fixture
def engine_factory():
    """Transfer engines that are always closed: ``engine_factory(directory=..., ...)``."""
    engines: list[TransferEngine] = []

    def make(**kw) -> TransferEngine:
        engine = TransferEngine(TransferConfig(**kw))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def peer_factory(metadata):
    """Real peer processes publishing in the ``metadata`` service; always stopped."""
    peers: list[PeerProcess] = []

    def make(segment: str, size: int, *extra: str) -> PeerProcess:
        peer = PeerProcess(segment, size, metadata.url, *extra)
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        peer.stop()
