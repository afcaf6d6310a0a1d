"""Object and replica descriptors between the master and its clients: typed, checked where the
answer arrives, and the ones a real master hands out decode to what it stores."""

from __future__ import annotations

import pytest

from kvpool.common.errors import ProtocolError
from kvpool.protocol.store import ObjectDesc, PutOptions, ReplicaDesc
from kvpool.store import EmbeddedStore

GOOD = {"key": "k", "size": 10, "checksum": 7, "lease_ttl": 10.0,
        "replicas": [{"node": "n1", "segment": "n1/dram", "offset": 64, "tier": "dram",
                      "owner": "abc"}]}  # fmt: skip


def test_round_trip():
    d = ObjectDesc("k", 10, (ReplicaDesc("n1", "n1/dram", 64, "dram", "abc"),), 7, 10.0, 5)
    assert ObjectDesc.from_wire(d.to_wire()) == d
    assert ObjectDesc.from_wire(GOOD).replicas[0].offset == 64
    assert ObjectDesc.maybe(None) is None
    assert ObjectDesc.from_wire({**GOOD, "put_id": 3}).put_id == 3


@pytest.mark.parametrize(
    "change",
    [
        {"key": 5},
        {"size": -1},
        {"size": True},
        {"checksum": "sum"},
        {"lease_ttl": -1},
        {"put_id": -2},
        {"replicas": "n1"},
        {"replicas": [{"node": "n1", "segment": "s", "offset": 0, "tier": "tape"}]},
        {"replicas": [{"node": "n1", "segment": "s", "offset": -4, "tier": "dram"}]},
        {"replicas": [{"node": 1, "segment": "s", "offset": 0, "tier": "dram"}]},
        {"replicas": [["n1", "s", 0, "dram"]]},
    ],
)
def test_malformed_descriptions_are_refused(change):
    with pytest.raises(ProtocolError):
        ObjectDesc.from_wire({**GOOD, **change})
    with pytest.raises(ProtocolError):
        ObjectDesc.from_wire([GOOD])


def test_a_real_master_describes_what_it_stores():
    pool = EmbeddedStore("8MiB")
    try:
        pool.put("k", b"v" * 100, options=PutOptions(soft_pin=True))
        desc = pool.replicas("k")
        assert isinstance(desc, ObjectDesc) and desc.size == 100 and desc.checksum is not None
        [r] = desc.replicas
        assert r.tier == "dram" and r.segment == pool.node.segment.name and r.owner
        assert bytes(pool.node.segment.array[r.offset : r.offset + 100]) == b"v" * 100
        assert pool.replicas("missing") is None
    finally:
        pool.close()
