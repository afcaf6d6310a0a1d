"""``kvpool sim calibrate`` on the real engine and model (quick): the profile it writes loads,
fits its own samples, and carries kvpool serve's serving limits."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.config import ClusterConfig
from kvpool.sim.profile import load_profile

pytestmark = pytest.mark.slow


def test_calibrate_writes_a_profile_of_this_machine(tmp_path):
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, "-m", "kvpool.cli", "sim", "calibrate", "--quick",
                    "--out", str(out)], check=True, timeout=600)  # fmt: skip
    p = load_profile(out)
    assert p.node.host_cores is not None and p.node.decode_tail
    assert p.node.prefill_chunk_tokens == ClusterConfig().prefill_chunk
    assert p.node.decode_chunk_tokens == ClusterConfig().decode_chunk
    assert p.measured["r2"] > 0.9 and len(p.measured["samples"]) >= 8
    assert p.network.bytes_per_s > 0
