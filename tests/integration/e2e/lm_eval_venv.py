"""lm-eval-harness in a virtualenv of its own (``.cache/lm-eval-venv``, git-ignored), installed
on first use as ``benchmarks/peers/vllm_peer.py`` installs vLLM: the CPU build of torch first
(``torch==2.13.0``; any other spec pulls a multi-GB CUDA build; when the tests run in kvpool's
venv, its torch is shared instead), then ``lm-eval[api]`` and the tokenizer library it uses,
at pinned versions. A marker file naming the specs makes later runs skip the install. lm-eval is not a kvpool dependency: kvpool never imports it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import share_torch  # noqa: E402

VENV = ROOT / ".cache" / "lm-eval-venv"
MARKER = VENV / "kvpool-install-ok.json"
LOG = ROOT / ".cache" / "lm-eval-install.log"
SPECS = ("torch==2.13.0", "lm-eval[api]==0.4.13", "transformers==5.25.0")
INSTALL_TIMEOUT_S = 1800


class InstallError(RuntimeError):
    """pip could not install lm-eval (the message says why, with the log's tail)."""


def python() -> Path:
    return VENV / "bin" / "python"


def lm_eval() -> Path:
    return VENV / "bin" / "lm_eval"


def installed() -> bool:
    try:
        info = json.loads(MARKER.read_text())
    except (OSError, ValueError):
        return False
    return tuple(info.get("specs", ())) == SPECS and lm_eval().is_file()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run(cmd: list[str], env: dict, timeout: float) -> None:
    with LOG.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, timeout=timeout, check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = -9
    if rc != 0:
        raise InstallError(f"`{' '.join(cmd[2:5])} ...` failed ({rc}); {LOG}:\n{_tail(LOG)}")


def ensure() -> float:
    """Install lm-eval unless the marker says it is there; the seconds the install took."""
    if installed():
        return 0.0
    t0 = time.monotonic()
    VENV.parent.mkdir(parents=True, exist_ok=True)
    if VENV.exists():
        shutil.rmtree(VENV)  # an install that never completed
    LOG.write_text(f"lm-eval install started {time.ctime()}\n")
    env = {**os.environ, "PIP_NO_INPUT": "1", "VIRTUAL_ENV": str(VENV),
           "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    pip = [str(python()), "-m", "pip", "install"]
    _run([sys.executable, "-m", "venv", str(VENV)], env, 120)
    if not share_torch(VENV, SPECS[0]):
        _run([*pip, SPECS[0]], env, INSTALL_TIMEOUT_S)  # torch alone first: its CPU build
    _run([*pip, *SPECS], env, INSTALL_TIMEOUT_S)
    MARKER.write_text(json.dumps({"specs": list(SPECS), "installed_at": time.ctime()}))
    return time.monotonic() - t0
