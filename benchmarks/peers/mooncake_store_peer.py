"""Mooncake Store as a peer for ``bench_store.py``: its master, a holder and the client driver.

Reuses the virtualenv of ``mooncake_transfer_peer.py`` (``.cache/bench/mooncake-venv`` with
``mooncake-transfer-engine-non-cuda``, installed on first use, libibverbs unpacked into it where
the machine lacks it) and its environment (``MC_FORCE_TCP=true``, ``LD_LIBRARY_PATH``). Starts
``mooncake_master -rpc_address=127.0.0.1 -rpc_port=P -metrics_host=127.0.0.1 -metrics_port=M
-enable_metric_reporting=false`` and a holder (``mooncake_store_inner.py holder``: a 1 GiB
global segment, warmed); ``driver_cmd`` gives the argv of the client driver
(``mooncake_store_inner.py client``), to run with ``env``.

``MooncakeStorePool.start`` never raises: on any failure it logs the reason, keeps it in
``last_error`` and returns None (the bench then skips Mooncake).
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mooncake_transfer_peer as mtp
from mooncake_transfer_peer import log

INNER_SCRIPT = Path(__file__).resolve().parent / "mooncake_store_inner.py"
MASTER_START_TIMEOUT_S = 30
HOLDER_START_TIMEOUT_S = 180

last_error: str | None = None


def _fail(msg: str) -> None:
    global last_error
    last_error = msg
    log(f"mooncake store: {msg}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _master_binary() -> Path | None:
    """The ELF ``mooncake_master`` in site-packages (bin/mooncake_master execs it)."""
    for p in sorted(mtp.VENV.glob("lib/python*/site-packages/mooncake/mooncake_master")):
        return p
    p = mtp.VENV / "bin" / "mooncake_master"
    return p if p.is_file() else None


def _drop_glog(text: str) -> str:
    """Without glog's info and warning lines (``I1129 12:00:00.000 ...``)."""
    keep = [ln for ln in text.splitlines() if not re.match(r"[IW]\d{4} ", ln)]
    return "\n".join(keep)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class MooncakeStorePool:
    """A running ``mooncake_master`` and holder process."""

    def __init__(self, python: Path, env: dict, master: str, info: dict) -> None:
        self.python, self.env, self.master, self.info = python, env, master, info
        self.master_proc: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None

    @classmethod
    def start(cls, segment_bytes: int, warm_bytes: int, logs: Path) -> MooncakeStorePool | None:
        global last_error
        last_error = None
        pool = None
        try:
            python = mtp.ensure_venv()
            if python is None:
                _fail(f"no Mooncake virtualenv: {mtp.last_error}")
                return None
            installed = mtp._installed() or {}
            env = mtp._env(extra_libs=bool(installed.get("extra_libs")))
            binary = _master_binary()
            if binary is None:
                _fail(f"no mooncake_master binary in {mtp.VENV}")
                return None
            logs.mkdir(parents=True, exist_ok=True)
            port, metrics = free_port(), free_port()
            info = {
                "mooncake_version": installed.get("version"),
                "mooncake_client": "put_from/get_into, batch_put_from/batch_get_into; "
                "client global_segment_size=0",
                "mooncake_segment_bytes": segment_bytes,
            }
            pool = cls(python, env, f"127.0.0.1:{port}", info)
            log(f"mooncake store: starting mooncake_master on {pool.master} and a holder")
            argv = [
                str(binary),
                "-rpc_address=127.0.0.1",
                f"-rpc_port={port}",
                "-metrics_host=127.0.0.1",
                f"-metrics_port={metrics}",
                "-enable_metric_reporting=false",
            ]
            with (logs / "mooncake-master.log").open("w") as out:
                pool.master_proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
                )
            pool._wait_master(port, logs / "mooncake-master.log")
            cfg = {"master": pool.master, "segment_bytes": segment_bytes, "warm_bytes": warm_bytes}
            with (logs / "mooncake-holder.log").open("w") as err:
                pool.holder = subprocess.Popen(
                    [str(python), str(INNER_SCRIPT), "holder", json.dumps(cfg)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    text=True,
                )
            ready, _, _ = select.select([pool.holder.stdout], [], [], HOLDER_START_TIMEOUT_S)
            line = pool.holder.stdout.readline() if ready else ""
            if not line:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pool.holder.wait(5)
                text = (logs / "mooncake-holder.log").read_text()
                tail = mtp._tail(_drop_glog(text), 4)
                raise RuntimeError(f"holder did not start (exit {pool.holder.poll()}): {tail}")
            log(f"mooncake store: holder ready, {json.loads(line)['warmed'] >> 20} MiB warmed")
            return pool
        except Exception as e:  # a peer must never break the benchmark
            _fail(f"start failed: {type(e).__name__}: {e}")
            if pool is not None:
                pool.close()
            return None

    def _wait_master(self, port: int, log_path: Path) -> None:
        deadline = time.monotonic() + MASTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.master_proc.poll() is not None:
                tail = mtp._tail(_drop_glog(log_path.read_text()), 4)
                raise RuntimeError(
                    f"mooncake_master exited ({self.master_proc.returncode}): {tail}"
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return
            time.sleep(0.2)
        raise RuntimeError(f"mooncake_master not listening on {port} after 30 s")

    def driver_cmd(self, cfg: dict) -> list[str]:
        cfg = {**cfg, "master": self.master}
        return [str(self.python), str(INNER_SCRIPT), "client", json.dumps(cfg)]

    def close(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            with contextlib.suppress(OSError):
                self.holder.stdin.close()
            try:
                self.holder.wait(15)
            except subprocess.TimeoutExpired:
                _stop(self.holder)
        _stop(self.master_proc)
