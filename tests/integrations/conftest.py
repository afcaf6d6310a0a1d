"""A real master and two ``MooncakeDistributedStore``s (a holder contributing memory, a pure
client) for the Mooncake adapter's tests."""

from __future__ import annotations

import pytest
from mooncake_helpers import LEASE_TTL, MiB

from kvpool.config import MasterConfig
from kvpool.integrations.mooncake import MooncakeDistributedStore
from kvpool.store.master.service import MasterService


@pytest.fixture(scope="module")
def master():
    service = MasterService(MasterConfig(lease_ttl=LEASE_TTL))
    server = service.serve()
    yield server.address
    server.close()
    service.close()


@pytest.fixture(scope="module")
def pool(master):
    """(holder contributing 64 MiB over TCP, pure client on shm), sharing the master's directory."""
    holder, client = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert holder.setup("localhost", "P2PHANDSHAKE", 64 * MiB, 16 * MiB, "tcp", "", master) == 0
    assert client.setup("127.0.0.1:12345", "P2PHANDSHAKE", 0, 16 * MiB, "rdma", "", master) == 0
    yield holder, client
    assert client.close() == 0
    assert holder.close() == 0
