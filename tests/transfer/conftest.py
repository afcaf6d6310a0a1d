from __future__ import annotations

import pytest
from transfer_peers import PeerProcess

from kvpool.config import TransferConfig
from kvpool.transfer import TransferEngine
from kvpool.transfer.metadata_server import MetadataServer


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
