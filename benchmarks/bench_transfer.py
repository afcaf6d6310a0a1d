"""Transfer engine vs the physical limits, side by side in one run.

- shared memory: numpy memcpy (one process, warm buffers) vs our shm READ from a segment owned
  by another process (``kvpool transfer peer``);
- TCP: a plain Python socket pair across two processes (8-byte request, ``sendall`` reply,
  ``recv_into`` a preallocated buffer) vs our TCP READ from the same peer process;
- aggregation: 64 requests of 64 KiB in one batch vs one 4 MiB request (shm and TCP);
- optionally Mooncake's transfer engine over TCP (``--with-mooncake``; its own virtualenv).

Baseline and ours alternate in rounds and each figure is the median round, so the noise of
this machine hits both. Prints GB/s and ratios; ``--json PATH`` writes "figures" and "ratios",
``--plot PATH`` draws them.

    .venv/bin/python benchmarks/bench_transfer.py --quick
    .venv/bin/python benchmarks/bench_transfer.py --with-mooncake --json docs/results/bench_transfer.json
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, log

from kvpool.config import TransferConfig
from kvpool.transfer import Op, TransferEngine, TransferRequest
from kvpool.transfer.metadata_server import MetadataServer

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"64KiB": 64 * KiB, "1MiB": MiB, "4MiB": 4 * MiB, "16MiB": 16 * MiB}
SEGMENT = 32 * MiB

SOCKET_PEER = textwrap.dedent(
    """
    import socket, struct, sys
    import numpy as np
    data = np.random.default_rng(0).integers(0, 256, %d, dtype=np.uint8)
    view = memoryview(data)
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(8)
    while True:
        got = 0
        while got < 8:
            k = conn.recv_into(memoryview(head)[got:])
            if not k:
                sys.exit(0)
            got += k
        (n,) = struct.unpack("<Q", head)
        conn.sendall(view[:n])
    """
)


def timed(fn: Callable[[], int], seconds: float, max_reps: int = 100_000) -> float:
    """GB/s of ``fn`` (returns bytes moved) repeated for about ``seconds``, after a warm-up."""
    fn()
    moved, reps = 0, 0
    t0 = time.perf_counter()
    while reps < max_reps:
        moved += fn()
        reps += 1
        if time.perf_counter() - t0 >= seconds:
            break
    return moved / (time.perf_counter() - t0) / 1e9


def duel(
    res: Results,
    key: str,
    ours: tuple[str, Callable[[], int]],
    base: tuple[str, Callable[[], int]],
    seconds: float,
    n: int,
) -> float:
    """Alternate ours and the baseline for ``n`` short rounds; record each one's median GB/s
    and the median of the per-round ratios (pairs taken close in time cancel the drift of this
    machine's speed). Returns our median GB/s."""
    mine, theirs = [], []
    for _ in range(n):
        theirs.append(timed(base[1], seconds))
        mine.append(timed(ours[1], seconds))
    res.figure(base[0], statistics.median(theirs))
    res.figure(ours[0], statistics.median(mine))
    ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
    res.ratio(key, statistics.median(ratios), 1.0)
    return statistics.median(mine)


class SocketBaseline:
    """The plain-socket pair: one connection to a child process that replies with N bytes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SOCKET_PEER % SEGMENT], stdout=subprocess.PIPE, text=True
        )
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read(self, buf: memoryview) -> int:
        n = len(buf)
        self.sock.sendall(n.to_bytes(8, "little"))
        got = 0
        while got < n:
            got += self.sock.recv_into(buf[got:], n - got)
        return n

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


def start_peer(directory: str, name: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvpool.cli", "transfer", "peer", "--segment", name]
    argv += ["--size", str(SEGMENT), "--directory", directory, *extra]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # ready line
    proc.stdin.write("fill 1\n")
    proc.stdin.flush()
    proc.stdout.readline()
    return proc


def batch_fn(te: TransferEngine, buf: np.ndarray, remote: str, n: int, size: int):
    """``n`` READs of ``size`` bytes in one batch; remote offsets strided (every other slot,
    backwards) so that nothing could merge them into one big request."""
    reqs = [
        TransferRequest(Op.READ, buf, remote, (2 * (n - 1 - i)) * size, size, local_offset=i * size)
        for i in range(n)
    ]

    def run() -> int:
        te.transfer(reqs)  # submit + wait; raises on any failure
        return n * size

    return run


def bench_shm(res: Results, te: TransferEngine, seconds: float, n: int) -> None:
    log("shared memory: numpy memcpy vs our shm READ from another process")
    src = np.random.default_rng(0).integers(0, 256, SEGMENT, dtype=np.uint8)
    dst = np.zeros(SEGMENT, dtype=np.uint8)
    for label, size in SIZES.items():

        def memcpy(size=size) -> int:
            np.copyto(dst[:size], src[:size])
            return size

        ours = batch_fn(te, dst, "bench/shm", 1, size)
        mine = (f"shm_read_GBps_{label}", ours)
        duel(res, f"shm_vs_memcpy_{label}", mine, (f"memcpy_GBps_{label}", memcpy), seconds, n)
    batch = ("shm_batch64x64KiB_GBps", batch_fn(te, dst, "bench/shm", 64, 64 * KiB))
    single = ("shm_read_GBps_4MiB_single", batch_fn(te, dst, "bench/shm", 1, 4 * MiB))
    duel(res, "batch64x64KiB_vs_4MiB_shm", batch, single, seconds, n)


def bench_tcp(res: Results, te: TransferEngine, seconds: float, n: int) -> dict:
    log("TCP: plain Python socket pair vs our TCP READ from another process")
    base = SocketBaseline()
    dst = np.zeros(SEGMENT, dtype=np.uint8)
    view = memoryview(dst)
    ours_by_size = {}
    try:
        for label, size in SIZES.items():
            ours = (f"tcp_read_GBps_{label}", batch_fn(te, dst, "bench/tcp", 1, size))
            sock = (f"socket_GBps_{label}", lambda size=size: base.read(view[:size]))
            ours_by_size[size] = duel(res, f"tcp_vs_socket_{label}", ours, sock, seconds, n)
    finally:
        base.close()
    src = np.random.default_rng(1).integers(0, 256, 16 * MiB, dtype=np.uint8)
    write = TransferRequest(Op.WRITE, src, "bench/tcp", 0)

    def write16() -> int:
        te.transfer([write])
        return 16 * MiB

    res.figure("tcp_write_GBps_16MiB", timed(write16, seconds))
    batch = ("tcp_batch64x64KiB_GBps", batch_fn(te, dst, "bench/tcp", 64, 64 * KiB))
    single = ("tcp_read_GBps_4MiB_single", batch_fn(te, dst, "bench/tcp", 1, 4 * MiB))
    ours_by_size["batch"] = duel(res, "batch64x64KiB_vs_4MiB", batch, single, seconds, n)
    return ours_by_size


def bench_mooncake(res: Results, ours: dict, quick: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    import mooncake_transfer_peer as mc

    log("Mooncake transfer engine (TCP, its own virtualenv)")
    sizes = [64 * KiB, MiB, 16 * MiB]
    out = mc.run(sizes, batch=64, seconds=0.5 if quick else 2.0, quick=quick)
    if out is None:
        log(f"Mooncake peer unavailable: {mc.last_error}")
        return
    res.args["mooncake_version"] = out.get("version")
    for size, label in zip(sizes, ("64KiB", "1MiB", "16MiB"), strict=True):
        theirs = out["read_GBps"].get(size) or out["read_GBps"].get(str(size))
        if theirs:
            res.figure(f"mooncake_tcp_read_GBps_{label}", theirs)
            res.ratio(f"tcp_vs_mooncake_{label}", ours[size], theirs)
    if out.get("batch64x64KiB_GBps"):
        res.figure("mooncake_tcp_batch64x64KiB_GBps", out["batch64x64KiB_GBps"])
        res.ratio("tcp_batch_vs_mooncake", ours["batch"], out["batch64x64KiB_GBps"])


def plot(res: Results, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    labels = ["64KiB", "1MiB", "16MiB"]
    series = {
        "memcpy": "memcpy_GBps_",
        "kvpool shm": "shm_read_GBps_",
        "socket pair": "socket_GBps_",
        "kvpool tcp": "tcp_read_GBps_",
        "mooncake tcp": "mooncake_tcp_read_GBps_",
    }
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.16
    for i, (name, prefix) in enumerate(series.items()):
        vals = [res.figures.get(prefix + lab, 0.0) for lab in labels]
        ax.bar([x + (i - 2) * width for x in range(len(labels))], vals, width, label=name)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("GB/s (READ, higher is better)")
    ax.set_title("kvpool transfer engine vs physical limits (2-core CPU host)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short rounds (under 2 minutes)")
    ap.add_argument("--json", default=None, help="write figures and ratios here")
    ap.add_argument("--plot", default=None, help="draw a PNG here")
    ap.add_argument("--streams", type=int, default=None, help="TCP connections per peer")
    ap.add_argument("--with-mooncake", action="store_true", help="also run Mooncake's engine")
    args = ap.parse_args()
    seconds, n_rounds = (0.1, 5) if args.quick else (0.3, 15)
    res = Results("bench_transfer", vars(args).copy())
    meta = MetadataServer()
    peers = [start_peer(meta.url, "bench/shm"), start_peer(meta.url, "bench/tcp", "--no-shm")]
    extra = {} if args.streams is None else {"num_streams": args.streams}
    te = TransferEngine(TransferConfig(directory=meta.url, **extra))
    try:
        bench_shm(res, te, seconds, n_rounds)
        ours = bench_tcp(res, te, seconds, n_rounds)
        if args.with_mooncake:
            bench_mooncake(res, ours, args.quick)
    finally:
        te.close()
        for p in peers:
            p.stdin.close()
            p.wait(10)
        meta.close()
    res.dump(args.json)
    if args.plot or args.json:
        plot(res, args.plot or str(Path(args.json).with_suffix(".png")))


if __name__ == "__main__":
    main()
