"""``kvpool serve``: the embedded single-machine cluster (CLI code: prints are fine).

Starts, in order: the pool (``kvpool store master``, which also serves the segment directory, and
one ``kvpool store node`` process), the workers (``kvpool worker`` processes: ``--prefill N``
and ``--decode M``, or ``--colocated N`` engines doing both with local prefix caching only), and
the conductor in this process on 127.0.0.1:8000. Each child gets its config (a ``WorkerConfig``,
a ``NodeConfig``) as JSON on its stdin (``--config-json -``); every child prints a JSON line when ready;
the conductor says ready only once it sees every worker alive. Ctrl-C or SIGTERM stops the
conductor, then the children (SIGTERM, then SIGKILL after a grace period); children also get
SIGTERM if this process dies (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from kvpool.common.errors import KVPoolError
from kvpool.config import ClusterConfig, HttpLimits, NodeConfig, WorkerConfig, to_wire

STARTUP_TIMEOUT = 300.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    argv: list[str]
    config: WorkerConfig | NodeConfig | None = None  # sent as JSON on its stdin
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)

    def start(self) -> None:
        argv = [*self.argv, "--config-json", "-"] if self.config is not None else self.argv
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", *argv], stdout=subprocess.PIPE, text=True,
            stdin=subprocess.PIPE if self.config is not None else subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent,
        )  # fmt: skip
        if self.config is not None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it died at once: wait_ready says so
                self.proc.stdin.write(json.dumps(to_wire(self.config)))
                self.proc.stdin.close()

    def wait_ready(self, timeout: float) -> dict:
        """The child's JSON ready line (stdout after it is forwarded to ours)."""
        assert self.proc is not None and self.proc.stdout is not None
        result: dict = {}

        def read() -> None:
            line = self.proc.stdout.readline()
            if line:
                result.update(json.loads(line))
            for rest in self.proc.stdout:  # keep forwarding whatever it prints
                print(f"[{self.name}] {rest}", end="", flush=True)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout
        while not result and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.05)
        if not result:
            raise KVPoolError(f"{self.name} did not start (exit code {self.proc.poll()})")
        self.info = result
        return result

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            print(f"kvpool serve: {self.name} ignored SIGTERM; killing it", flush=True)
            self.proc.kill()
            self.proc.wait(5)


def plan(cluster: ClusterConfig) -> tuple[list[Child], list[Child]]:
    """(pool processes, worker processes) of ``cluster``; the node and the workers need the
    master's address, filled in by ``launch`` once the master is up."""
    pool: list[Child] = []
    if not cluster.colocated:
        pool.append(Child("store-master", ["store", "master", "--port", "0",
                                           "--log-level", "warning"]))  # fmt: skip
        node = NodeConfig(memory=cluster.store_memory, log_level="warning")
        pool.append(Child("store-node", ["store", "node"], node))  # the master's directory
    roles = ["both"] * cluster.colocated if cluster.colocated else \
        ["prefill"] * cluster.prefill + ["decode"] * cluster.decode  # fmt: skip
    threads = cluster.engine.num_threads or max(1, (os.cpu_count() or 2) // max(1, len(roles)))
    # what the conductor relays, the workers accept
    http = HttpLimits(max_body_bytes=cluster.conductor.http.max_body_bytes)
    workers = []
    counts: dict[str, int] = {}
    for role in roles:
        counts[role] = counts.get(role, 0) + 1
        wid = f"{role}-{counts[role]}"
        own = cluster.decode_threads if role == "decode" and cluster.decode_threads else threads
        engine = dataclasses.replace(cluster.engine, num_threads=own)
        chunk = {"prefill": cluster.prefill_chunk, "decode": cluster.decode_chunk}.get(role)
        if chunk:
            engine = dataclasses.replace(engine, max_num_batched_tokens=chunk)
        cfg = WorkerConfig(role=role, worker_id=wid, engine=engine, http=http,
                           log_level="warning")  # fmt: skip
        workers.append(Child(wid, ["worker"], cfg))
    return pool, workers


def launch(cluster: ClusterConfig, token: str | None) -> int:
    from kvpool.entrypoints.conductor import build, serve_conductor
    from kvpool.transfer.metadata import directory_for

    pool, workers = plan(cluster)
    children: list[Child] = []
    conductor = None
    ledger = share_cores(cluster, workers)
    try:
        master = None
        for child in pool:
            if isinstance(child.config, NodeConfig):
                child.config.master = master or ""
            child.start()
            children.append(child)
            info = child.wait_ready(60)
            master = master or info.get("address")
            print(f"kvpool serve: {child.name} ready ({info.get('address') or info.get('segment')})",
                  flush=True)  # fmt: skip
        for child in workers:  # all load their model at once
            assert isinstance(child.config, WorkerConfig)
            child.config.store = master
            child.start()
            children.append(child)
        for child in workers:
            info = child.wait_ready(STARTUP_TIMEOUT)
            print(
                f"kvpool serve: worker {info['id']} ({info['role']}) ready: http "
                f"{info['http']}, rpc {info['rpc']}, pid {info['pid']}",
                flush=True,
            )
        front = dataclasses.replace(cluster.conductor, workers=[c.info["rpc"] for c in workers],
                                    store=master, etcd=None)  # fmt: skip
        conductor = build(front, token)
        conductor.cluster.processes = {
            c.name: {"pid": c.proc.pid, **{k: v for k, v in c.info.items() if k != "ready"}}
            for c in children
            if c.proc is not None
        }
        conductor.cluster.directory = directory_for(master) if master else None
        _wait_all_alive(conductor, len(workers))

        def ready() -> None:
            print(
                f"kvpool serve: ready on http://{front.host}:{front.port}/v1 "
                f"({_describe(cluster)}; Ctrl-C stops everything)",
                flush=True,
            )

        asyncio.run(serve_conductor(conductor, front, ready))
    except KeyboardInterrupt:
        print("kvpool serve: interrupted, shutting down", flush=True)
    except KVPoolError as exc:
        print(f"kvpool serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if conductor is not None:
            conductor.cluster.close()
        for child in reversed(children):
            child.stop()
        if ledger is not None:
            from kvpool.engine.core_share import release_ledger

            ledger.unlink(missing_ok=True)
            release_ledger(ledger)
        print("kvpool serve: stopped", flush=True)
    return 0


def share_cores(cluster: ClusterConfig, workers: list[Child]):
    """The workers' core ledger (engine/core_share.py), each worker given its slot; None when
    sharing is off, threads were set by hand, or there is one worker. Returns its path."""
    if not cluster.share_cores or len(workers) < 2 or cluster.engine.num_threads or \
            cluster.decode_threads:  # fmt: skip
        return None
    from kvpool.engine.core_share import create_ledger, host_cores

    try:
        path = create_ledger(len(workers), host_cores())
    except OSError as exc:
        print(f"kvpool serve: no core sharing ({exc}); each worker keeps its share", flush=True)
        return None
    for slot, child in enumerate(workers):
        assert isinstance(child.config, WorkerConfig)
        child.config.core_ledger, child.config.core_slot = str(path), slot
    return path


def _wait_all_alive(conductor, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [w for w in conductor.cluster.snapshot().workers if w.alive]
        if len(alive) >= n:
            return
        time.sleep(0.1)
    raise KVPoolError(f"only {len(alive)} of {n} workers answer the conductor")


def _describe(cluster: ClusterConfig) -> str:
    if cluster.colocated:
        return f"{cluster.colocated} colocated worker(s), local prefix caching only"
    return (f"{cluster.prefill} prefill + {cluster.decode} decode worker(s), pool of "
            f"{cluster.store_memory / 2**30:.2f} GiB")  # fmt: skip
