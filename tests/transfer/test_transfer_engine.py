"""Transfer engine behaviour inside one process (two engines, real sockets and shm)."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvpool.common.errors import BadRequestError, NotFoundError, TransferError
from kvpool.config import TransferConfig
from kvpool.transfer import Op, State, TransferEngine, TransferRequest
from kvpool.transfer.metrics import TransferStatsCollector


@pytest.fixture
def pair(engine_factory):
    owner = engine_factory()
    seg = owner.register("owner/kv", size=1 << 20)
    seg.array[:] = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
    return owner, seg, engine_factory()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_torch_tensor_buffers_both_ways(pair, transport):
    _owner, seg, te = pair
    te.config.transport = transport
    t = torch.zeros(256, dtype=torch.bfloat16)
    te.read(t, "owner/kv", 1000)
    assert t.view(torch.uint8).numpy().tobytes() == seg.array[1000:1512].tobytes()
    src = torch.arange(100, dtype=torch.float32)
    te.write(src, "owner/kv", 4)
    assert seg.array[4:404].view(np.float32).tolist() == list(range(100))


def test_registered_tensor_is_served_in_place_over_tcp(engine_factory):
    owner = engine_factory()
    kv = torch.zeros(4, 2, 16, dtype=torch.float32)  # e.g. an engine's KV tensor
    seg = owner.register("owner/tensor", kv)
    assert seg.shm_name is None and seg.size == kv.numel() * 4
    te = engine_factory()
    te.write(np.full(16, 2.5, np.float32), "owner/tensor", 64)
    assert kv.view(-1)[16:32].tolist() == [2.5] * 16  # written straight into the tensor
    assert te.stats.snapshot().bytes[("tcp", "write")] == 64


def test_segment_tensor_view_and_local_copy(engine_factory):
    te = engine_factory()
    seg = te.register("me/kv", size=4096)
    view = seg.tensor(torch.float32, (8, 16))
    view.fill_(1.0)
    out = np.zeros(512, np.uint8)
    te.read(out, "me/kv")  # own segment: a local copy
    assert np.frombuffer(out, np.float32).tolist() == [1.0] * 128
    with pytest.raises(BadRequestError):
        seg.tensor(torch.float32, (1025,))


def test_bad_requests_are_rejected_before_anything_moves(pair):
    _owner, _seg, te = pair
    buf = np.zeros(100, np.uint8)
    with pytest.raises(BadRequestError, match="outside segment"):
        te.read(buf, "owner/kv", (1 << 20) - 99)
    with pytest.raises(BadRequestError, match="outside the 100-byte buffer"):
        te.read(buf, "owner/kv", local_offset=50, length=51)
    with pytest.raises(BadRequestError):
        te.read(buf, "owner/kv", -1)
    with pytest.raises(BadRequestError, match="read-only"):
        te.read(b"immutable", "owner/kv")
    with pytest.raises(BadRequestError, match="contiguous"):
        te.read(np.zeros((10, 10), np.uint8)[:, 0], "owner/kv")
    with pytest.raises(NotFoundError):
        te.read(buf, "nobody/kv")
    good = TransferRequest(Op.READ, buf, "owner/kv", 0)
    bad = TransferRequest(Op.READ, buf, "owner/kv", 1 << 30)
    with pytest.raises(BadRequestError):
        te.submit([good, bad])
    assert te.stats.snapshot().requests == {}  # the good one never started either


def test_server_rejects_out_of_bounds_even_when_the_descriptor_lies(pair):
    owner, seg, te = pair
    te.config.transport = "tcp"
    real = te.resolve("owner/kv")
    te._descs["owner/kv"] = dataclasses.replace(real, size=real.size * 2)  # a forged size
    before = seg.array.copy()
    data = np.full(4096, 7, np.uint8)
    handle = te.submit([TransferRequest(Op.WRITE, data, "owner/kv", real.size - 10)])
    (status,) = handle.wait(10)
    assert status.state is State.FAILED and isinstance(status.error, BadRequestError)
    assert "outside the registered segment" in status.reason
    assert np.array_equal(seg.array, before)
    te.read(np.zeros(10, np.uint8), "owner/kv")  # the same connection still serves
    forged_id = dataclasses.replace(real, segment_id=999)
    te._descs["owner/kv"] = forged_id
    (status,) = te.submit([TransferRequest(Op.READ, data, "owner/kv")]).wait(10)
    assert isinstance(status.error, NotFoundError)
    assert owner.stats.snapshot().errors["bounds"] == 1


def test_asyncio_transfer_does_not_block_the_loop(pair):
    _owner, seg, te = pair
    te.config.transport = "tcp"
    buf = np.zeros(1 << 20, np.uint8)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        reqs = [TransferRequest(Op.READ, buf, "owner/kv", 0) for _ in range(20)]
        statuses = await te.transfer_async(reqs)
        task.cancel()
        return statuses, ticks

    statuses, ticks = asyncio.run(main())
    assert all(s.ok for s in statuses) and ticks > 10
    assert np.array_equal(buf, seg.array)


def test_done_callback_and_poll(pair):
    _owner, _seg, te = pair
    seen = []
    handle = te.submit([TransferRequest(Op.READ, np.zeros(10, np.uint8), "owner/kv")])
    handle.add_done_callback(lambda h: seen.append(h.done()))
    handle.wait(10)
    assert handle.done() and seen == [True]
    handle.raise_for_status()
    handle.add_done_callback(lambda h: seen.append("late"))  # already done: called at once
    assert seen == [True, "late"]


def test_auth_token_is_checked_in_the_handshake(engine_factory):
    owner = engine_factory(auth_token="s3cret")
    owner.register("secure/kv", size=4096)
    stranger = engine_factory(transport="tcp", auth_token="wrong")
    with pytest.raises(TransferError, match="could not prove it holds the cluster token"):
        stranger.read(np.zeros(8, np.uint8), "secure/kv")  # it does not trust the owner
    anonymous = engine_factory(transport="tcp")
    with pytest.raises(TransferError, match="authentication failed"):
        anonymous.read(np.zeros(8, np.uint8), "secure/kv")  # the owner does not trust it
    friend = engine_factory(transport="tcp", auth_token="s3cret")
    assert friend.read(np.zeros(8, np.uint8), "secure/kv") == 8
    assert owner.stats.snapshot().errors["auth"] == 1
    open_owner = engine_factory()
    open_owner.register("open/kv", size=4096)
    with pytest.raises(TransferError, match="runs without one"):
        friend.read(np.zeros(8, np.uint8), "open/kv")  # a client with a token wants proof


def test_non_loopback_bind_requires_a_token(monkeypatch):
    monkeypatch.delenv("KVPOOL_AUTH_TOKEN", raising=False)
    with pytest.raises(ValueError, match="auth token"):
        TransferConfig(host="0.0.0.0")
    monkeypatch.setenv("KVPOOL_AUTH_TOKEN", "t")
    assert TransferConfig(host="0.0.0.0").auth_token == "t"


@pytest.mark.parametrize(
    "kw",
    [{"transport": "rdma"}, {"slice_bytes": 10}, {"num_streams": 0}, {"request_timeout": 0},
     {"spin_us": -1}, {"spin_us": 10**6}],
)  # fmt: skip
def test_config_validation(kw):
    with pytest.raises(ValueError):
        TransferConfig(**kw)


def test_register_errors_and_unregister(engine_factory):
    te = engine_factory()
    with pytest.raises(BadRequestError):
        te.register("x")
    with pytest.raises(BadRequestError):
        te.register("", size=10)
    seg = te.register("x/kv", size=10)
    shm_name = seg.shm_name
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(BadRequestError):
        te.register("x/kv", size=10)
    assert set(os.listdir("/dev/shm")) == before  # the refused one leaves no file behind
    other = engine_factory()
    with pytest.raises(Exception, match="already registered"):
        other.register("x/kv", size=10)  # a live owner holds the name
    te.unregister("x/kv")
    with pytest.raises(NotFoundError):
        other.read(np.zeros(1, np.uint8), "x/kv")
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    with pytest.raises(NotFoundError):
        te.unregister("x/kv")


def test_close_fails_nothing_silently_and_frees_shm(engine_factory):
    te = TransferEngine(TransferConfig())
    seg = te.register("closing/kv", size=8192)
    name = seg.shm_name
    te.close()
    import os

    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(TransferError, match="closed"):
        te.submit([])
    te.close()  # idempotent


def test_prometheus_metrics(pair):
    owner, _seg, te = pair
    te.read(np.zeros(1000, np.uint8), "owner/kv")
    te.config.transport = "tcp"
    te.write(np.zeros(24, np.uint8), "owner/kv")
    reg = CollectorRegistry()
    reg.register(TransferStatsCollector(te.stats.snapshot))
    text = generate_latest(reg).decode()
    assert 'kvpool_transfer_bytes_total{direction="read",transport="shm"} 1000.0' in text
    assert 'kvpool_transfer_bytes_total{direction="write",transport="tcp"} 24.0' in text
    assert 'kvpool_transfer_requests_total{direction="read",transport="shm"} 1.0' in text
    assert "kvpool_transfer_latency_seconds_count 2.0" in text
    assert "kvpool_transfer_inflight_bytes 0.0" in text
    reg2 = CollectorRegistry()
    reg2.register(TransferStatsCollector(owner.stats.snapshot))
    assert (
        'kvpool_transfer_served_bytes_total{direction="write"} 24.0'
        in generate_latest(reg2).decode()
    )
