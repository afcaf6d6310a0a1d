"""The worker status message: typed on both ends, checked when decoded."""

from __future__ import annotations

import pytest

from kvpool.common.errors import ProtocolError
from kvpool.common.rpc import pack, unpack
from kvpool.protocol.worker import CostModel, EngineStatus, KVEvent, WorkerStatus


def status(**over) -> WorkerStatus:
    fields = dict(id="w1", role="decode", http="127.0.0.1:1", rpc="127.0.0.1:2", model="m",
                  pid=7, alive=True, namespace="ns", block_size=16, block_bytes=4096,
                  max_model_len=2048, vocab_size=100,
                  load=EngineStatus(3, 40, 2, 1, 1, 0.25, (5, 9)),
                  cost=CostModel(0.01, 0.002, 0.03, 0.001), counters={"steps": 3},
                  event_seq=12, events=(KVEvent(11, "stored", b"\x01" * 16),
                                        KVEvent(12, "removed", b"\x02" * 16)))  # fmt: skip
    fields.update(over)
    return WorkerStatus(**fields)


def test_round_trip_through_the_wire():
    st = status()
    back = WorkerStatus.from_wire(unpack(pack(st.to_wire())))
    assert back.events == st.events and back.cost == st.cost and back.snapshot is None
    assert back.load.queued_prefill_tokens == 40 and back.load.remaining_tokens == (5, 9)
    assert back.load.loading == 1
    snap = status(events=(), snapshot=(b"\x03" * 16,))
    assert WorkerStatus.from_wire(unpack(pack(snap.to_wire()))).snapshot == (b"\x03" * 16,)
    assert back.step_tokens == 0  # unknown
    assert WorkerStatus.from_wire(status(step_tokens=256).to_wire()).step_tokens == 256
    older = status().to_wire()
    del older["step_tokens"]  # a worker from before the field: unknown
    assert WorkerStatus.from_wire(older).step_tokens == 0


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d: d.pop("namespace"), "namespace"),
        (lambda d: d.update(block_size="16"), "block_size"),
        (lambda d: d.update(alive=1), "alive"),
        (lambda d: d.update(events=[[1, "evicted", "00"]]), "event"),
        (lambda d: d.update(events=[[1, "stored", "zz"]]), "block hash"),
        (lambda d: d.update(events=[["1", "stored", "00"]]), "event"),
        (lambda d: d.update(events="all"), "events"),
        (lambda d: d.update(snapshot={"a": 1}), "snapshot"),
        (lambda d: d["load"].pop("running"), "load"),
        (lambda d: d.update(load=[1, 2]), "load"),
        (lambda d: d.update(cost={"prefill_token_s": "fast"}), "cost"),
        (lambda d: d.update(step_tokens=-1), "step_tokens"),
        (lambda d: d.update(step_tokens=2.5), "step_tokens"),
    ],
)
def test_a_malformed_status_is_a_protocol_error(change, why):
    wire = status().to_wire()
    change(wire)
    with pytest.raises(ProtocolError, match=why):
        WorkerStatus.from_wire(wire)


def test_not_a_mapping():
    with pytest.raises(ProtocolError):
        WorkerStatus.from_wire([1, 2, 3])
