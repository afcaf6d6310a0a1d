"""Redis as a peer for ``bench_store.py``: a loopback ``redis-server`` and a redis-py driver.

The server: ``redis-server`` from PATH; else Debian's ``redis-tools`` binary
(``redis-check-rdb``, the same executable, run as ``redis-server`` through argv[0]), installed
with ``apt-get install -y redis-tools`` when missing (as root; this avoids the ``redis-server``
package, whose install starts a system service on port 6379). Started with ``--save ""
--appendonly no --bind 127.0.0.1 --port P`` (no persistence, no memory limit: nothing evicts).

The client: redis-py + hiredis in their own virtualenv (``.cache/bench/redis-venv``, installed
on first use; not a project dependency). The driver (this file run with that venv's python)
sets ``redis.connection.HIREDIS_AVAILABLE = False`` before connecting: commands are then packed
by redis-py's Python serializer (hiredis packs large SETs several times slower), while replies
are still parsed by whichever parser redis-py bound at import (the JSON args say which). Single:
SET / GET (GET returns a new ``bytes``: redis-py has no read-into); batched: one MSET / MGET.

``RedisServer.start`` never raises: on failure it logs why, keeps it in ``last_error`` and
returns None (the bench then skips Redis).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

try:
    from common import CACHE, log
except ImportError:  # run as a driver from benchmarks/peers/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from common import CACHE, log

VENV = CACHE / "redis-venv"
SPECS = ("redis>=5", "hiredis>=2")
MARKER = VENV / "kvpool-install-ok.json"
INSTALL_LOG = CACHE / "redis-install.log"
START_TIMEOUT_S = 20

last_error: str | None = None


def _fail(msg: str) -> None:
    global last_error
    last_error = msg
    log(f"redis: {msg}")


def _run(cmd: list[str], timeout: float = 600) -> tuple[int, str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PIP_NO_INPUT": "1"}
    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
        )
        code, out = p.returncode, p.stdout + p.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        code, out = -1, str(e)
    with INSTALL_LOG.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}  # exit {code}\n{out}")
    return code, out


def _tail(text: str, n: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_server() -> tuple[str, str] | None:
    """(executable, argv0) of a Redis server, installing Debian's redis-tools if needed."""
    if path := shutil.which("redis-server"):
        return path, "redis-server"
    if not shutil.which("redis-check-rdb"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            _fail("no redis-server on PATH, and not root with apt-get to install redis-tools")
            return None
        CACHE.mkdir(parents=True, exist_ok=True)
        log("redis: installing Debian's redis-tools (apt-get)")
        code, out = _run(["apt-get", "install", "-y", "--no-install-recommends", "redis-tools"])
        if code != 0:
            _run(["apt-get", "update"])
            code, out = _run(["apt-get", "install", "-y", "--no-install-recommends", "redis-tools"])
        if code != 0 or not shutil.which("redis-check-rdb"):
            _fail(f"apt-get install redis-tools failed: {_tail(out)}")
            return None
    return shutil.which("redis-check-rdb"), "redis-server"


def ensure_venv() -> Path | None:
    python = VENV / "bin" / "python"
    try:
        if json.loads(MARKER.read_text()).get("specs") == list(SPECS) and python.is_file():
            return python
    except (OSError, ValueError):
        pass
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(VENV, ignore_errors=True)
    log(f"redis: installing {' '.join(SPECS)} into {VENV}")
    base = shutil.which("python3") or sys.executable
    for cmd in (
        [base, "-m", "venv", str(VENV)],
        [str(python), "-m", "pip", "install", "-q", *SPECS],
    ):
        code, out = _run(cmd)
        if code != 0:
            _fail(f"`{' '.join(cmd[-3:])}` failed: {_tail(out)}")
            return None
    MARKER.write_text(json.dumps({"specs": list(SPECS), "installed_at": time.ctime()}) + "\n")
    return python


class RedisServer:
    """A running loopback redis-server and the python of the driver's venv."""

    def __init__(self, proc: subprocess.Popen, port: int, python: Path, info: dict) -> None:
        self.proc, self.port, self.python, self.info = proc, port, python, info
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    @classmethod
    def start(cls, logs: Path) -> RedisServer | None:
        global last_error
        last_error = None
        proc = None
        try:
            server = find_server()
            python = ensure_venv()
            if server is None or python is None:
                return None
            executable, argv0 = server
            port = _free_port()
            logs.mkdir(parents=True, exist_ok=True)
            argv = [argv0, "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]
            argv += ["--port", str(port), "--logfile", str(logs / "redis-server.log")]
            proc = subprocess.Popen(
                argv, executable=executable, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
            )
            version = cls._wait(proc, port)
            log(f"redis: redis-server {version} on 127.0.0.1:{port}")
            info = {"redis_server_version": version, "redis_batch": "MSET / MGET"}
            return cls(proc, port, python, info)
        except Exception as e:  # a peer must never break the benchmark
            _fail(f"start failed: {type(e).__name__}: {e}")
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)
            return None

    @staticmethod
    def _wait(proc: subprocess.Popen, port: int) -> str:
        import socket

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({proc.returncode})")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), 1) as s,
            ):
                s.sendall(b"INFO server\r\n")
                time.sleep(0.05)
                reply = s.recv(65536).decode(errors="replace")
                for line in reply.splitlines():
                    if line.startswith("redis_version:"):
                        return line.split(":", 1)[1].strip()
            time.sleep(0.2)
        raise RuntimeError(f"redis-server not answering on {port} after {START_TIMEOUT_S} s")

    def driver_cmd(self, cfg: dict) -> list[str]:
        cfg = {**cfg, "port": self.port}
        return [str(self.python), str(Path(__file__).resolve()), "--driver", json.dumps(cfg)]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- the driver (runs under the redis venv's python) -----------------------------------------


class RedisStore:
    """The workload's adapter for redis-py."""

    def __init__(self, port: int) -> None:
        import redis
        import redis.connection

        redis.connection.HIREDIS_AVAILABLE = False  # Python packer: large SETs go much faster
        self.r = redis.Redis(host="127.0.0.1", port=port)
        self.r.ping()
        conn = self.r.connection_pool.get_connection()
        self.info = {
            "redis_py_version": redis.__version__,
            "redis_packer": type(getattr(conn, "_command_packer", None)).__name__,
            "redis_parser": type(getattr(conn, "_parser", None)).__name__,
            "redis_hiredis_available": False,
        }
        self.r.connection_pool.release(conn)

    def alloc(self, nbytes: int) -> memoryview:
        from bench_store import alloc_buffer

        self._mm, self.mv = alloc_buffer(nbytes)
        return self.mv

    def put(self, key: str, off: int, size: int) -> None:
        if not self.r.set(key, self.mv[off : off + size]):
            raise RuntimeError(f"SET {key} failed")

    def get(self, key: str, off: int, size: int):
        return self.r.get(key)

    def batch_put(self, keys: list[str], offs: list[int], size: int) -> None:
        mapping = {k: self.mv[o : o + size] for k, o in zip(keys, offs, strict=True)}
        if not self.r.mset(mapping):
            raise RuntimeError("MSET failed")

    def batch_get(self, keys: list[str], offs: list[int], size: int) -> list:
        return self.r.mget(keys)

    def remove(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1024):
            self.r.delete(*keys[i : i + 1024])

    def close(self) -> None:
        self.r.close()


def driver(cfg: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench_store import run_workload

    store = RedisStore(int(cfg["port"]))
    try:
        out = run_workload(store, cfg)
    finally:
        store.close()
    out["info"] = store.info
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--driver":
        print(json.dumps(driver(json.loads(sys.argv[2]))), flush=True)
    else:
        print(__doc__)
