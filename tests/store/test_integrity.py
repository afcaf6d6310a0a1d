"""What a read trusts: the checksum is keyed (a MAC) when the cluster has a token."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.common import auth
from kvpool.common.errors import NotFoundError
from kvpool.store import EmbeddedStore
from kvpool.store.integrity import checksum, checksum_parts


@pytest.mark.parametrize("token", ["", "cluster-secret"])
def test_rewritten_bytes_are_a_miss_never_a_hit(token):
    pool = EmbeddedStore("8MiB", token=token)
    try:
        value = b"a" * 4096
        pool.put("k", value)
        meta = pool.master.call("get", "k")
        if token:  # a keyed MAC of the key and the value: no one without the token can match it
            assert meta["checksum"] != checksum(value)
            key = auth.derive_key(token, auth.KV_MAC)
            assert meta["checksum"] == checksum_parts([value], "k", key)
            assert meta["checksum"] != checksum_parts([value], "other-key", key)
        else:
            assert meta["checksum"] == checksum(value)
        r = meta["replicas"][0]
        forged = np.frombuffer(b"b" * 4096, np.uint8)
        pool.node.segment.array[r["offset"] : r["offset"] + 4096] = forged  # behind the pool's back
        pool.leases.clear()
        with pytest.raises(NotFoundError, match="no readable replica"):
            pool.get("k")
        assert pool.batch_get(["k"]) == [None]
    finally:
        pool.close()
