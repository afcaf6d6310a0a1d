"""RPC benchmark: kvpool's RpcClient/RpcServer against two raw echo servers, same payload.

Baselines: a raw TCP echo (a thread per connection, blocking sockets, the same length-prefixed
framing) -- the floor for any Python RPC over TCP -- and a raw ZeroMQ REQ/REP echo (the
transport kvpool's RPC used before; its I/O threads cost a hand-off per message).

Each server runs in its own process on 127.0.0.1 (spawned); both sides are measured in one
invocation, in interleaved rounds (median of the rounds reported).
Workloads (ratios printed):
  roundtrip   sequential no-op calls with small args: p50/p99 latency (µs) and ops/s
  threads4    4 client threads, one client (socket) each: total ops/s
  shared4     4 threads sharing one RpcClient (its lock serialises them; kvpool only)
The baseline server echoes the request bytes unchanged; its client packs and unpacks the same
msgpack request that RpcClient sends, so the ratio is the cost of the RPC layer itself.

  python benchmarks/bench_rpc.py [--quick] [--json PATH] [--workers 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, log

from kvpool.common.rpc import RpcClient, RpcServer, pack, unpack

ARGS = [7, "block-key", b"\x00" * 16]
KWARGS = {"replicas": 2, "pin": False}
BUDGET_S = 20.0  # hard cap per workload, whatever the call counts say


def noop(*args: object, **kwargs: object) -> None:
    """The benchmarked handler: does nothing, returns nil."""


def serve_rpc(ports: mp.Queue, stop: mp.Event, workers: int) -> None:
    with RpcServer({"noop": noop}, workers=workers) as srv:
        ports.put(srv.port)
        stop.wait(600)


def serve_raw(ports: mp.Queue, stop: mp.Event) -> None:
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    ports.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    deadline = time.monotonic() + 600
    while not stop.is_set() and time.monotonic() < deadline:
        if sock.poll(100, zmq.POLLIN):
            sock.send(sock.recv())
    sock.close(linger=0)


def serve_tcp(ports: mp.Queue, stop: mp.Event) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    ports.put(listener.getsockname()[1])

    def echo(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                header = conn.recv(4, socket.MSG_WAITALL)
                if len(header) < 4:
                    return
                body = conn.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)
                conn.sendall(header + body)

    deadline = time.monotonic() + 600
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        threading.Thread(target=echo, args=(conn,), daemon=True).start()
    listener.close()


class TcpClient:
    """A blocking socket sending the same framed msgpack request RpcClient would."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rid = 0

    def call(self) -> object:
        self.rid += 1
        body = pack(["noop", self.rid, ARGS, KWARGS])  # RpcClient's request, byte for byte
        self.sock.sendall(len(body).to_bytes(4, "big") + body)
        header = self.sock.recv(4, socket.MSG_WAITALL)
        return unpack(self.sock.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL))

    def close(self) -> None:
        self.sock.close()


class RawClient:
    """REQ socket sending the same msgpack request RpcClient would (the baseline)."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.rid = 0

    def call(self) -> object:
        self.rid += 1
        self.sock.send(pack(["noop", self.rid, ARGS, KWARGS]))
        if not self.sock.poll(5000, zmq.POLLIN):
            raise TimeoutError("raw echo server did not answer")
        return unpack(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)


def latency(call: Callable[[], object], n: int) -> tuple[list[float], float]:
    """Per-call latencies (µs) of ``n`` sequential calls and the ops/s over them."""
    samples: list[float] = []
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - t0) / 1000)
        if time.perf_counter() - start > BUDGET_S:
            break
    return samples, len(samples) / (time.perf_counter() - start)


def throughput(calls: list[Callable[[], object]], n_each: int) -> float:
    """Total ops/s of one thread per entry of ``calls``, each doing ``n_each`` calls."""
    done = [0] * len(calls)
    barrier = threading.Barrier(len(calls) + 1)

    def run(i: int) -> None:
        barrier.wait(30)
        end = time.perf_counter() + BUDGET_S
        for _ in range(n_each):
            calls[i]()
            done[i] += 1
            if time.perf_counter() > end:
                break

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    barrier.wait(30)
    start = time.perf_counter()
    for t in threads:
        t.join(BUDGET_S + 30)
    return sum(done) / (time.perf_counter() - start)


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


def measure(clients: list, call: Callable, n: int) -> dict[str, float]:
    """Latency on one client, then throughput with one thread per client."""
    samples, ops = latency(lambda: call(clients[0]), n)
    return {
        "roundtrip_p50_us": statistics.median(samples),
        "roundtrip_p99_us": p99(samples),
        "ops_s_1thread": ops,
        "ops_s_4threads": throughput([lambda c=c: call(c) for c in clients], n),
    }


def start_server(ctx: mp.context.SpawnContext, target: Callable, *args: object):
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(ports, stop, *args), daemon=True)
    proc.start()
    return proc, stop, ports.get(timeout=60)


def stop_server(proc: mp.Process, stop: mp.Event) -> None:
    stop.set()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer calls (under 30 seconds)")
    ap.add_argument("--json", metavar="PATH", help="write figures and ratios as JSON")
    ap.add_argument("--workers", type=int, default=1, help="RpcServer handler threads")
    args = ap.parse_args()
    n, warmup, rounds = (2000, 300, 3) if args.quick else (10000, 2000, 5)
    res = Results("bench_rpc", vars(args))
    ctx = mp.get_context("spawn")
    raw_proc, raw_stop, raw_port = start_server(ctx, serve_raw)
    tcp_proc, tcp_stop, tcp_port = start_server(ctx, serve_tcp)
    rpc_proc, rpc_stop, rpc_port = start_server(ctx, serve_rpc, args.workers)
    raws = [RawClient(raw_port) for _ in range(4)]
    tcps = [TcpClient(tcp_port) for _ in range(4)]
    rpcs = [RpcClient(f"127.0.0.1:{rpc_port}") for _ in range(4)]
    rpc_call = lambda c: c.call("noop", *ARGS, **KWARGS)  # noqa: E731
    runs: dict[str, list[dict[str, float]]] = {"raw_zmq": [], "raw_tcp": [], "rpc": []}
    try:
        for _ in range(warmup):
            raws[0].call()
            tcps[0].call()
            rpc_call(rpcs[0])
        for r in range(rounds):  # interleaved, so load changes hit every side alike
            log(f"round {r + 1}/{rounds}: raw ZeroMQ echo, raw TCP echo, kvpool RPC, {n} calls")
            runs["raw_zmq"].append(measure(raws, RawClient.call, n))
            runs["raw_tcp"].append(measure(tcps, TcpClient.call, n))
            runs["rpc"].append(measure(rpcs, rpc_call, n))
        for side, results in runs.items():
            for key in results[0]:
                res.figure(f"{side}_{key}", statistics.median(x[key] for x in results))
        shared = [lambda: rpc_call(rpcs[0])] * 4
        res.figure("rpc_ops_s_4threads_shared_client", throughput(shared, n))
    finally:
        for c in [*raws, *tcps, *rpcs]:
            c.close()
        stop_server(raw_proc, raw_stop)
        stop_server(tcp_proc, tcp_stop)
        stop_server(rpc_proc, rpc_stop)

    f = res.figures
    res.ratio("rpc_vs_raw_tcp_roundtrip", f["rpc_ops_s_1thread"], f["raw_tcp_ops_s_1thread"])
    res.ratio("rpc_vs_raw_tcp_4threads", f["rpc_ops_s_4threads"], f["raw_tcp_ops_s_4threads"])
    res.ratio(
        "rpc_vs_raw_tcp_p50_latency",
        f["rpc_roundtrip_p50_us"],
        f["raw_tcp_roundtrip_p50_us"],
        higher_is_better=False,
    )
    res.ratio("rpc_vs_raw_zmq_roundtrip", f["rpc_ops_s_1thread"], f["raw_zmq_ops_s_1thread"])
    res.ratio("rpc_vs_raw_zmq_4threads", f["rpc_ops_s_4threads"], f["raw_zmq_ops_s_4threads"])
    res.ratio(
        "rpc_vs_raw_zmq_p50_latency",
        f["rpc_roundtrip_p50_us"],
        f["raw_zmq_roundtrip_p50_us"],
        higher_is_better=False,
    )
    res.dump(args.json)


if __name__ == "__main__":
    main()
