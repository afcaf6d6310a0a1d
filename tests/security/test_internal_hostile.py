"""Hostile peers against the cluster's internal servers (the store master and node, the
workers' control RPC, the segment directory, the transfer servers), bounded and on 127.0.0.1:
strangers are refused, malformed or oversized input costs bounded memory and CPU, and the
pool's objects keep their owners."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import numpy as np
import pytest
from conftest import Cluster, closed_within
from support.raw_rpc import frame, raw_conn, read_frame, request

from kvpool.common.errors import (
    AlreadyExistsError,
    AuthError,
    BadRequestError,
    ForbiddenError,
    KVPoolError,
    NotFoundError,
    TransferError,
)
from kvpool.common.rpc import RpcClient
from kvpool.config import TransferConfig
from kvpool.transfer import TransferEngine
from kvpool.transfer import protocol as P

pytestmark = pytest.mark.slow


def master(c: Cluster) -> str:
    return c.process("store-master")["address"]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def node_descriptor(c: Cluster) -> dict:
    assert c.doc["directory"] == f"rpc://{master(c)}"  # the master serves the directory
    with member(c, master(c)) as rpc:
        listed = rpc.call("dir_list")
    segment = c.process("store-node")["segment"]
    return next(d for d in listed if d["name"] == segment)


def member(c: Cluster, address: str) -> RpcClient:
    return RpcClient(address, token=c.token or "", timeout=10)


def test_strangers_are_refused_everywhere(alive):
    workers = alive.workers()
    rpc_servers = [master(alive), alive.process("store-node")["rpc"], *[w["rpc"] for w in workers]]
    if alive.token is None:  # open: loopback only, nobody proves anything ...
        with RpcClient(master(alive), token="", timeout=5) as c:
            assert c.call("stats")["nodes"] == 1
        for address in rpc_servers:  # ... and a client holding a token trusts none of them
            c = RpcClient(address, token="a-token", timeout=5)
            with c, pytest.raises(AuthError, match="runs without one"):
                c.call("stats")
        return
    for address in rpc_servers:
        for token in ["", "wrong-token"]:
            with RpcClient(address, token=token, timeout=5) as c, pytest.raises(AuthError):
                c.call("stats")  # "status" on workers: refused before the method matters
    desc = node_descriptor(alive)
    with socket.create_connection((desc["host"], desc["port"]), timeout=10) as s:
        s.sendall(P.HELLO.pack(P.MAGIC, P.VERSION, 0, bytes(16)))
        _, status, wants_proof, _, _ = P.CHALLENGE.unpack(s.recv(P.CHALLENGE.size))
        assert status == P.Status.OK and wants_proof == 1
        s.sendall(P.PROOF.pack(P.NO_PROOF))  # a client without the token
        assert s.recv(P.WELCOME.size) == P.WELCOME.pack(P.MAGIC, P.Status.BAD_TOKEN)
    # with the token the same calls work (the refusals were about the token)
    with member(alive, master(alive)) as c:
        assert c.call("stats")["nodes"] == 1


def test_rpc_servers_survive_garbage_and_silence(alive):
    for address in [master(alive), alive.workers()[0]["rpc"]]:
        host, port = "127.0.0.1", port_of(address)
        for junk in [os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n", (1 << 31).to_bytes(4, "big"),
                     frame(b"\xc1" * 100)]:  # fmt: skip
            with socket.create_connection((host, port), timeout=5) as s, \
                    contextlib.suppress(OSError):  # fmt: skip
                s.sendall(junk)
                assert closed_within(s, 7)  # refused, or dropped at the handshake deadline
        silent = socket.create_connection((host, port), timeout=5)
        assert closed_within(silent, 7)  # 5 s to prove the token, then closed
        silent.close()


def test_the_master_validates_what_members_send(alive):
    with member(alive, master(alive)) as c:
        start = c.call("put_start", "sec/forged", 64)
        with pytest.raises(NotFoundError):
            c.call("put_end", "sec/forged", start["put_id"] + 1, 0)  # not the put id handed out
        with pytest.raises(NotFoundError):
            c.call("put_revoke", "sec/forged", 12345)
        c.call("put_revoke", "sec/forged", start["put_id"])
        for replicas in [-1, 0, 17, 10**9]:
            with pytest.raises(BadRequestError, match="replicas"):
                c.call("put_start", "sec/r", 64, replicas)
        for bad in [[["k"]], "k", [[1, 2, 3, 4]], [None]]:
            with pytest.raises(BadRequestError):
                c.call("batch_put_end", bad)
        assert c.call("batch_put_end", [["k", 1, "x"]]) == [False]  # no such put: nothing ends
        with pytest.raises(BadRequestError):
            c.call("put_start", "sec/k", -5)
        with pytest.raises(BadRequestError):
            c.call("mount", "fake-node", "fake/dram", "dram", 2**60)
        if alive.token:  # a member may not force a remove: that is an admin call
            with pytest.raises(ForbiddenError, match="admin"):
                c.call("remove", "anything", True)


def _probe_frames() -> list[bytes]:
    """Messages of at most 8 MiB (the largest a bulk method takes) that decode to as many
    Python objects as they can: empty arrays, nested, behind every kind of method."""
    empties = b"\x90" * 60_000
    group = b"\xdc" + (60_000).to_bytes(2, "big") + empties  # an array of 60,000 empty arrays
    nested = b"\xdc" + (130).to_bytes(2, "big") + group * 130  # 7.8 M empty arrays
    frames = []
    for method in [b"batch_exists", b"batch_tiers", b"report", b"get", b"nope"]:
        head = b"\x94" + bytes([0xA0 | len(method)]) + method + b"\x01"
        frames.append(frame(head + b"\x91" + nested + b"\x80"))
    frames.append(frame(b"\xdd" + (8_000_000).to_bytes(4, "big") + b"\x90" * 8_000_000))
    return frames


def test_amplification_probe_costs_bounded_memory(alive):
    pid = alive.process("store-master")["pid"]
    before = rss_bytes(pid)
    for _ in range(3):
        for data in _probe_frames():
            with contextlib.ExitStack() as stack:
                if alive.token:  # before authenticating only the hello may be sent
                    s = stack.enter_context(socket.create_connection(("127.0.0.1",
                                                                      port_of(master(alive)))))  # fmt: skip
                    read_frame(s)
                else:
                    s = stack.enter_context(raw_conn(port_of(master(alive)), timeout=30))
                with contextlib.suppress(OSError):
                    s.sendall(data)
                    reply = read_frame(s)
                    assert reply[1] is False, reply
    grown = rss_bytes(pid) - before
    assert grown < 2 * (8 << 20), f"the master grew by {grown >> 20} MiB"
    with member(alive, master(alive)) as c:
        assert c.call("batch_exists", ["x"] * 10) == [False] * 10


def test_a_client_that_never_reads_does_not_spin_the_master(alive):
    pid = alive.process("store-master")["pid"]
    greedy = raw_conn(port_of(master(alive)), token=alive.token, timeout=2)
    big = request("batch_exists", 1, [["k" * 4000] * 2000])  # 8 MB in, 16 KB out per request
    small = request("stats", 2, [])
    with contextlib.suppress(OSError):
        for _ in range(3000):
            greedy.sendall(small)
    del big
    time.sleep(1.0)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(2.0)
    busy = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    assert busy < 0.5, f"the master burns {busy:.0%} of a core on a client that never reads"
    with member(alive, master(alive)) as c:
        assert c.call("stats")["nodes"] == 1
    greedy.close()


def test_transfer_servers_refuse_bad_frames_and_bounds(alive):
    desc = node_descriptor(alive)
    addr = (desc["host"], desc["port"])
    for hello in [os.urandom(64), P.HELLO.pack(b"HTTP", 2, 0, bytes(16)), b"KVTE\x01\x00"]:
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(hello)
            assert closed_within(s, 7)
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(P.HELLO.pack(P.MAGIC, 1, 0, bytes(16)))  # v1 sent the token in clear
        assert P.CHALLENGE.unpack(s.recv(P.CHALLENGE.size))[1] == P.Status.BAD_VERSION
    if alive.token is None:  # a peer reads only inside the segment
        te = TransferEngine(TransferConfig(transport="tcp", directory=alive.doc["directory"]))
        try:
            buf = np.zeros(4096, np.uint8)
            with pytest.raises(BadRequestError, match="outside"):
                te.read(buf, desc["name"], desc["size"] - 100)
            with pytest.raises((TransferError, KVPoolError)):
                te.read(buf, "no/such/segment")
        finally:
            te.close()


def test_the_directory_trusts_no_descriptor(alive):
    real = node_descriptor(alive)
    key = "k" * 32
    forged = [{"shm_name": "../../home/user/.bashrc"}, {"shm_name": "/etc/passwd"},
              {"host": "10.9.9.9"}, {"port": 70000}, {"segment_id": -1}]  # fmt: skip
    with member(alive, master(alive)) as rpc:
        for change in forged:
            with pytest.raises(BadRequestError):
                rpc.call("dir_put", {**real, "name": "sec-evil", **change}, key, 10)
        for bad_key in ["", "short", 5, "k" * 500]:
            with pytest.raises(BadRequestError, match="owner_key"):
                rpc.call("dir_put", {**real, "name": "sec-evil2"}, bad_key, 10)
        # the node's own entry: not replaced (its owner id is public, its key is not) ...
        with pytest.raises(AlreadyExistsError):
            rpc.call("dir_put", {**real, "port": 1}, key, 10)
        # ... and not withdrawn
        assert rpc.call("dir_delete", real["name"], key) is False
    assert node_descriptor(alive) == real


def test_bad_prefill_calls_do_not_hurt_the_worker(alive):
    prefill = alive.workers("prefill")[0]
    with member(alive, prefill["rpc"]) as c:
        for ids in [[1, 10**9], [-1], list(range(1, 5000)), "text", []]:
            with pytest.raises(BadRequestError):
                c.call("prefill", "sec-1", ids)
    assert all(w["alive"] for w in alive.workers())
