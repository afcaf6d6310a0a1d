"""vLLM's own Mooncake store connector (``MooncakeStoreConnector``) as a peer of KVPoolConnector,
on this CPU-only machine.

Set-up, all inside the benchmark cache (no system change):
- the Mooncake wheel (``mooncake_transfer_peer.MOONCAKE_SPEC``, the CPU build) installed into
  vLLM's venv with ``--no-deps`` (its dependencies are vLLM's already), with the
  ``libibverbs`` the wheel links even for TCP, from ``mooncake_transfer_peer``;
- a ``sitecustomize`` directory on vLLM's ``PYTHONPATH``: the connector creates
  ``torch.cuda.Event()`` in ``wait_for_save`` (vllm 0.32, ``mooncake/store/worker.py``), which
  torch's CPU build refuses to construct; the shim gives it an event that is already
  complete, which is what an event is on the CPU (the step's copies finish before the save
  runs). vLLM spawns its worker processes, so the shim has to be in every interpreter;
- ``mooncake_master`` and a process holding a 2 GiB segment on 127.0.0.1, and a client
  config (``MOONCAKE_CONFIG_PATH``): P2P hand-shake metadata, TCP, vLLM's
  ``standalone-store`` mode (in ``embedded`` mode each vLLM process would hold the segment,
  and its objects would go with it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mooncake_store_peer as msp
import mooncake_transfer_peer as mtp
from common import CACHE, log
from vllm_peer import _python as vllm_python

SITE = CACHE / "mooncake-vllm-site"
SHIM = '''"""kvpool benchmark shim: torch.cuda.Event on a CPU-only torch (see mooncake_vllm_peer)."""
import torch

if not torch.cuda.is_available():
    class _DoneEvent:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, *args, **kwargs):
            pass

        def synchronize(self):
            pass

        def wait(self, *args, **kwargs):
            pass

        def query(self):
            return True

    torch.cuda.Event = _DoneEvent
'''


def _libs_env() -> dict:
    dirs = [str(d) for d in mtp._lib_dirs() if d.is_dir()]
    return {"LD_LIBRARY_PATH": os.pathsep.join(dirs)} if dirs else {}


def ensure() -> None:
    """The wheel in vLLM's venv and the shim; RuntimeError with the reason if impossible."""
    if mtp.ensure_venv() is None:  # the wheel's own venv: also fetches libibverbs if missing
        raise RuntimeError(f"no Mooncake virtualenv: {mtp.last_error}")
    SITE.mkdir(parents=True, exist_ok=True)
    (SITE / "sitecustomize.py").write_text(SHIM)
    probe = [str(vllm_python()), "-c", "import mooncake.store"]
    env = {**os.environ, **_libs_env()}
    env.pop("PYTHONPATH", None)
    if subprocess.run(probe, env=env, capture_output=True, check=False).returncode == 0:
        return
    log(f"mooncake: installing {mtp.MOONCAKE_SPEC} into vLLM's venv (--no-deps)")
    code, _, err = mtp._logged("install into vllm venv", [str(vllm_python()), "-m", "pip",
                               "install", "-q", "--no-deps", mtp.MOONCAKE_SPEC], 600)  # fmt: skip
    if code != 0:
        raise RuntimeError(f"installing {mtp.MOONCAKE_SPEC} into vLLM's venv failed: {err[-500:]}")
    if subprocess.run(probe, env=env, capture_output=True, check=False).returncode != 0:
        raise RuntimeError("mooncake.store does not import in vLLM's venv")


class MooncakeMaster:
    """``mooncake_master`` and a segment holder on 127.0.0.1 (``mooncake_store_peer``: the
    pool outlives the vLLM processes, as kvpool's node does), and the environment a vLLM
    process needs: vLLM's ``standalone-store`` mode (it contributes no segment)."""

    def __init__(self, logs: Path, segment_bytes: int = 2 << 30) -> None:
        self.pool = msp.MooncakeStorePool.start(segment_bytes, 0, logs)
        if self.pool is None:
            raise RuntimeError(f"no Mooncake store: {msp.last_error}")
        self.config = logs / "mooncake-client.json"
        self.config.write_text(json.dumps({
            "metadata_server": "P2PHANDSHAKE", "master_server_address": self.pool.master,
            "protocol": "tcp", "device_name": "", "mode": "standalone-store",
            "global_segment_size": 0, "local_buffer_size": "256MB"}))  # fmt: skip

    def env(self) -> dict:
        """What a vLLM process with ``MooncakeStoreConnector`` needs in its environment."""
        return {**_libs_env(), "PYTHONPATH": str(SITE), "MC_FORCE_TCP": "true",
                "MOONCAKE_CONFIG_PATH": str(self.config),
                "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}  # fmt: skip

    def close(self) -> None:
        self.pool.close()
