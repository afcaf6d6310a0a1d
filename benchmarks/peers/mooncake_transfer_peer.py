"""Mooncake's own transfer engine over TCP as a peer for ``bench_transfer.py``.

On first use this installs ``mooncake-transfer-engine-non-cuda`` into its own virtualenv under
the benchmark cache (``.cache/bench/mooncake-venv``, ~10-15 s; a marker file makes later runs
skip it) and runs ``mooncake_transfer_inner.py`` with that venv's python: two TransferEngine
processes on 127.0.0.1 (``MC_FORCE_TCP=true``, metadata by ``P2PHANDSHAKE``), timing
``transfer_sync_read`` / ``transfer_sync_write`` per size and one ``batch_transfer_sync_read``
of ``batch`` x 64 KiB. This module never imports mooncake, and the subprocess never imports
kvpool.

The wheel's ``engine.so`` links ``libibverbs.so.1`` even for TCP. Where the machine lacks it,
the install fetches Debian's ``libibverbs1`` (and its libnl deps) with ``apt-get download`` and
unpacks them inside the venv (no system change); ``run`` puts them on ``LD_LIBRARY_PATH``.

``run`` never raises: on any failure it logs the reason, keeps it in ``last_error`` and returns
None. Knob: KVPOOL_BENCH_MOONCAKE_TIMEOUT (seconds per measurement run, default derived from the
sizes and seconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

try:
    from common import CACHE, log
except ImportError:  # run as a script from benchmarks/peers/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from common import CACHE, log

MOONCAKE_SPEC = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# Debian packages that provide libibverbs.so.1 (engine.so needs it to load, even for TCP)
IBVERBS_DEBS = ("libibverbs1", "libnl-3-200", "libnl-route-3-200")

VENV = CACHE / "mooncake-venv"
MARKER = VENV / "kvpool-install-ok.json"
INSTALL_LOG = CACHE / "mooncake-install.log"
LIBS_DIR = VENV / "ibverbs-root"
INNER_SCRIPT = Path(__file__).resolve().parent / "mooncake_transfer_inner.py"

INSTALL_TIMEOUT_S = 600
PROBE_TIMEOUT_S = 120
PROBE = (
    "import json, importlib.metadata as m, mooncake.engine as e; "
    "print(json.dumps({'version': m.version('mooncake-transfer-engine-non-cuda'), "
    "'batch_api': hasattr(e.TransferEngine, 'batch_transfer_sync_read')}))"
)

last_error: str | None = None  # why the last ensure_venv()/run() gave None


def _fail(msg: str) -> None:
    global last_error
    last_error = msg
    log(f"mooncake: {msg}")


def _python() -> Path:
    return VENV / "bin" / "python"


def _lib_dirs() -> list[Path]:
    return [LIBS_DIR / "usr" / "lib" / "x86_64-linux-gnu", LIBS_DIR / "lib" / "x86_64-linux-gnu"]


def _env(extra_libs: bool) -> dict:
    env = {**os.environ, "PIP_NO_INPUT": "1", "VIRTUAL_ENV": str(VENV), "MC_FORCE_TCP": "true"}
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    if extra_libs:
        dirs = [str(d) for d in _lib_dirs()]
        if env.get("LD_LIBRARY_PATH"):
            dirs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs)
    return env


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None):
    """(exit code, stdout, stderr) of ``cmd``; on timeout kills its process group: (-9, ...)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -9, out, err + f"\n[timed out after {timeout:.0f} s]"


def _logged(what: str, cmd: list[str], timeout: float, env: dict | None = None, cwd=None):
    code, out, err = _run(cmd, timeout, env, cwd)
    with INSTALL_LOG.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}  # {what}: exit {code}\n{out}{err}")
    return code, out, err


# -- install -------------------------------------------------------------------------------


def _installed() -> dict | None:
    try:
        info = json.loads(MARKER.read_text())
    except (OSError, ValueError):
        return None
    if info.get("spec") != MOONCAKE_SPEC or not _python().is_file():
        return None
    return info


def _probe(extra_libs: bool) -> tuple[dict | None, str]:
    code, out, err = _logged(
        "probe import", [str(_python()), "-c", PROBE], PROBE_TIMEOUT_S, _env(extra_libs)
    )
    if code == 0:
        try:
            return json.loads(out.strip().splitlines()[-1]), ""
        except (ValueError, IndexError):
            return None, f"probe printed no JSON: {out[-300:]!r}"
    return None, _tail(err, 3)


def _fetch_ibverbs() -> str:
    """Unpack Debian's libibverbs1 + libnl into LIBS_DIR; returns '' or why it failed."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        return "no apt-get/dpkg-deb to fetch libibverbs1"
    debs = CACHE / "mooncake-debs"
    shutil.rmtree(debs, ignore_errors=True)
    debs.mkdir(parents=True)
    cmd = ["apt-get", "download", *IBVERBS_DEBS]
    code, _, err = _logged("apt-get download", cmd, 300, cwd=debs)
    if code != 0 and os.geteuid() == 0:  # package lists may be missing: refresh once
        _logged("apt-get update", ["apt-get", "update"], 300)
        code, _, err = _logged("apt-get download", cmd, 300, cwd=debs)
    if code != 0:
        return f"apt-get download {' '.join(IBVERBS_DEBS)} failed: {_tail(err, 2)}"
    shutil.rmtree(LIBS_DIR, ignore_errors=True)
    for deb in sorted(debs.glob("*.deb")):
        code, _, err = _logged("unpack", ["dpkg-deb", "-x", str(deb), str(LIBS_DIR)], 120)
        if code != 0:
            return f"dpkg-deb -x {deb.name} failed: {_tail(err, 2)}"
    return ""


def ensure_venv() -> Path | None:
    """Install MOONCAKE_SPEC into VENV unless the marker says it is there.

    Returns the venv's python, or None (reason logged, kept in ``last_error``).
    """
    global last_error
    last_error = None
    try:
        info = _installed()
        if info:
            return _python()
        CACHE.mkdir(parents=True, exist_ok=True)
        if VENV.exists():
            log(f"mooncake: {VENV} has no completed install, removing it")
            shutil.rmtree(VENV)
        INSTALL_LOG.write_text(f"mooncake install started {time.ctime()}\n")
        log(f"mooncake: installing {MOONCAKE_SPEC} into {VENV} (~15 s); log: {INSTALL_LOG}")
        start = time.monotonic()
        env = _env(extra_libs=False)
        steps = [
            ("create venv", [shutil.which("python3") or sys.executable, "-m", "venv", str(VENV)]),
            ("install", [str(_python()), "-m", "pip", "install", "-q", MOONCAKE_SPEC]),
        ]
        for what, cmd in steps:
            code, _, err = _logged(what, cmd, INSTALL_TIMEOUT_S, env)
            if code != 0:
                _fail(f"install step '{what}' failed (exit {code}): {_tail(err, 3)}")
                return None
        probe, why = _probe(extra_libs=False)
        extra_libs = False
        if probe is None and "libibverbs" in why:
            log("mooncake: engine.so needs libibverbs.so.1; unpacking Debian's into the venv")
            why_fetch = _fetch_ibverbs()
            if why_fetch:
                _fail(f"`import mooncake.engine` fails ({why}); {why_fetch}")
                return None
            extra_libs = True
            probe, why = _probe(extra_libs=True)
        if probe is None:
            _fail(f"`import mooncake.engine` fails: {why}")
            return None
        info = {
            "spec": MOONCAKE_SPEC,
            **probe,
            "extra_libs": extra_libs,
            "installed_at": time.ctime(),
            "install_seconds": round(time.monotonic() - start, 1),
        }
        MARKER.write_text(json.dumps(info, indent=2) + "\n")
        log(f"mooncake: installed {info['version']} in {info['install_seconds']:.0f} s")
        return _python()
    except Exception as e:  # a peer must never break the benchmark
        _fail(f"install failed: {type(e).__name__}: {e}")
        return None


# -- measurement ---------------------------------------------------------------------------


def run(
    sizes: list[int], batch: int = 64, seconds: float = 2.0, quick: bool = False
) -> dict | None:
    """GB/s of Mooncake TCP READ and WRITE per size, and of one batch read of ``batch`` x 64 KiB.

    Returns {"read_GBps": {size: GB/s}, "write_GBps": {...}, "batch64x64KiB_GBps": GB/s | None,
    "batch_pieces": batch, "version": "..."} (GB = 1e9 bytes), or None (reason logged).
    """
    global last_error
    try:
        python = ensure_venv()
        if python is None:
            return None
        last_error = None
        info = _installed() or {}
        if quick:
            seconds = min(seconds, 0.5)
        cfg = {"sizes": [int(s) for s in sizes], "batch": int(batch), "seconds": float(seconds)}
        # per timed loop: ~seconds + warm-up; 2 loops per size, 1 batch loop, plus start-up
        default_timeout = 60 + 3 * seconds * (2 * len(sizes) + 1)
        timeout = float(os.environ.get("KVPOOL_BENCH_MOONCAKE_TIMEOUT", default_timeout))
        log(
            f"mooncake: TCP transfer on 127.0.0.1, sizes {cfg['sizes']}, "
            f"batch {batch} x 64 KiB, {seconds:g} s each"
        )
        env = _env(extra_libs=bool(info.get("extra_libs")))
        code, out, err = _run([str(python), str(INNER_SCRIPT), json.dumps(cfg)], timeout, env)
        if code != 0:
            _fail(f"measurement failed (exit {code}): {_tail(err, 8)}")
            return None
        res = json.loads(out.strip().splitlines()[-1])
        for key in ("read_GBps", "write_GBps"):
            res[key] = {int(k): v for k, v in res[key].items()}
        res.pop("session", None)
        return res
    except Exception as e:  # a peer must never break the benchmark
        _fail(f"run failed: {type(e).__name__}: {e}")
        return None


if __name__ == "__main__":
    result = run([65536, 1048576, 16777216], quick=True)
    print(json.dumps(result if result is not None else {"error": last_error}, indent=2))
