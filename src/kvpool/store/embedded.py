"""Embedded mode: a master and one storage node inside the calling process (no etcd)."""

from __future__ import annotations

import itertools

from kvpool.common import auth
from kvpool.config import MasterConfig, TransferConfig, parse_size
from kvpool.store.client import StoreClient
from kvpool.store.client import transfer_config as with_token
from kvpool.store.master.service import MasterService
from kvpool.store.node import StorageNode
from kvpool.transfer import TransferEngine

_ids = itertools.count(1)


class EmbeddedStore(StoreClient):
    """A whole single-machine pool: ``EmbeddedStore(memory="512MiB")`` is a ready client."""

    def __init__(
        self,
        memory: int | str = "256MiB",
        master_config: MasterConfig | None = None,
        transfer_config: TransferConfig | None = None,
        node_id: str | None = None,  # default: unique, so several can live in one process
        ssd_path: str | None = None,
        ssd_size: int | str = 0,
        token: str | None = None,  # the cluster token (None: from the environment)
        admin_token: str | None = None,
    ) -> None:
        node_id = node_id or f"embedded-{next(_ids)}"
        token = auth.cluster_token(token) or ""
        self.service = MasterService(master_config, token=token, admin_token=admin_token)
        self.server = self.service.serve()
        engine = TransferEngine(with_token(transfer_config, token, self.server.address))
        self.node = StorageNode(
            node_id,
            self.server.address,
            parse_size(memory),
            engine,
            token=token,
            ssd_path=ssd_path,
            ssd_size=parse_size(ssd_size),
        )
        super().__init__(self.server.address, engine, token=token, admin_token=admin_token)
        self._engine = engine

    def close(self) -> None:
        super().close()
        self.node.close()
        self._engine.close()
        self.server.close()
        self.service.close()
