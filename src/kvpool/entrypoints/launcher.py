"""``kvpool serve``: the embedded single-machine cluster (CLI code: prints are fine).

Starts, in order: the pool (``kvpool store master``, which also serves the segment directory, and
one ``kvpool store node`` process), the workers (``kvpool worker`` processes: ``--prefill N``
and ``--decode M``, or ``--colocated N`` engines doing both with local prefix caching only), and
the conductor in this process on 127.0.0.1:8000. Every child prints a JSON line when ready;
the conductor says ready only once it sees every worker alive. Ctrl-C or SIGTERM stops the
conductor, then the children (SIGTERM, then SIGKILL after a grace period); children also get
SIGTERM if this process dies (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from kvpool.common.errors import KVPoolError

STARTUP_TIMEOUT = 300.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", *self.argv], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent,
        )  # fmt: skip

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


def plan(args: argparse.Namespace) -> tuple[list[Child], list[Child]]:
    """(pool processes, worker processes) for ``args``; the workers need the master address,
    filled in by ``launch`` once the master is up."""
    log = ["--log-level", "warning"]
    pool: list[Child] = []
    if not args.colocated:
        pool.append(Child("store-master", ["store", "master", "--port", "0", *log]))
        node = ["store", "node", "--master", "{master}", "--memory", args.store_memory, *log]
        pool.append(Child("store-node", node))  # the master's directory: the default
    roles = ["both"] * args.colocated if args.colocated else \
        ["prefill"] * args.prefill + ["decode"] * args.decode  # fmt: skip
    threads = str(args.threads or max(1, (os.cpu_count() or 2) // max(1, len(roles))))
    engine = [*_engine_flags(args), "--threads", threads]
    workers = []
    counts: dict[str, int] = {}
    for role in roles:
        counts[role] = counts.get(role, 0) + 1
        wid = f"{role}-{counts[role]}"
        argv = [
            "worker",
            "--role",
            role,
            "--id",
            wid,
            *engine,
            *log,
            "--max-body-bytes",
            str(args.max_body_bytes),
        ]  # what the conductor relays
        if role == "prefill" and args.prefill_chunk:
            argv += ["--max-num-batched-tokens", str(args.prefill_chunk)]  # the last one wins
        if not args.colocated:
            argv += ["--store", "{master}"]
        workers.append(Child(wid, argv))
    return pool, workers


def _engine_flags(args: argparse.Namespace) -> list[str]:
    out = ["--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory),
           "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    if args.model:
        out += ["--model", args.model]
    if args.max_model_len:
        out += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    return out


def launch(args: argparse.Namespace, token: str | None) -> int:
    from kvpool.entrypoints.conductor import build, serve_conductor
    from kvpool.transfer.metadata import directory_for

    pool, workers = plan(args)
    children: list[Child] = []
    conductor = None
    try:
        master = None
        for child in pool:
            child.argv = [a.replace("{master}", master or "") for a in child.argv]
            child.start()
            children.append(child)
            info = child.wait_ready(60)
            master = master or info.get("address")
            print(f"kvpool serve: {child.name} ready ({info.get('address') or info.get('segment')})",
                  flush=True)  # fmt: skip
        for child in workers:  # all load their model at once
            child.argv = [a.replace("{master}", master or "") for a in child.argv]
            child.start()
            children.append(child)
        for child in workers:
            info = child.wait_ready(STARTUP_TIMEOUT)
            print(
                f"kvpool serve: worker {info['id']} ({info['role']}) ready: http "
                f"{info['http']}, rpc {info['rpc']}, pid {info['pid']}",
                flush=True,
            )
        args.store, args.etcd = master, None
        conductor = build(args, [c.info["rpc"] for c in workers], token)
        conductor.cluster.processes = {
            c.name: {"pid": c.proc.pid, **{k: v for k, v in c.info.items() if k != "ready"}}
            for c in children
            if c.proc is not None
        }
        conductor.cluster.directory = directory_for(master) if master else None
        _wait_all_alive(conductor, len(workers))

        def ready() -> None:
            print(
                f"kvpool serve: ready on http://{args.host}:{args.port}/v1 "
                f"({_describe(args)}; Ctrl-C stops everything)",
                flush=True,
            )

        asyncio.run(serve_conductor(conductor, args, ready))
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
        print("kvpool serve: stopped", flush=True)
    return 0


def _wait_all_alive(conductor, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [w for w in conductor.cluster.snapshot().workers if w.alive]
        if len(alive) >= n:
            return
        time.sleep(0.1)
    raise KVPoolError(f"only {len(alive)} of {n} workers answer the conductor")


def _describe(args: argparse.Namespace) -> str:
    if args.colocated:
        return f"{args.colocated} colocated worker(s), local prefix caching only"
    return f"{args.prefill} prefill + {args.decode} decode worker(s), pool of {args.store_memory}"
