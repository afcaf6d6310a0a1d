"""``kvpool store`` command line: YAML config files and flag precedence."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.cli import build_parser
from kvpool.entrypoints.store import apply_config


def parse(*argv: str):
    return build_parser().parse_args(["store", *argv])


def test_yaml_fills_flags_not_given(tmp_path):
    cfg = tmp_path / "node.yaml"
    cfg.write_text("memory: 2GiB\nmaster: 127.0.0.1:6000\nnode-id: n7\nmetrics_port: 9100\n")
    args = parse("node", "--config", str(cfg), "--memory", "1GiB")
    apply_config(args, "node")
    assert args.memory == "1GiB"  # the command line wins
    assert (args.master, args.node_id, args.metrics_port) == ("127.0.0.1:6000", "n7", 9100)


def test_yaml_rejects_unknown_settings(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("replicas: 2\nwatermark: 0.5\n")
    args = parse("master", "--config", str(cfg))
    with pytest.raises(ValueError, match="unknown setting 'watermark'"):
        apply_config(args, "master")
    cfg.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        apply_config(parse("master", "--config", str(cfg)), "master")


def test_master_process_reads_its_config(tmp_path):
    from support.ports import free_port

    port = free_port()
    cfg = tmp_path / "master.yaml"
    cfg.write_text(f"port: {port}\nreplicas: 2\nlease-ttl: 5\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "store", "master", "--config", str(cfg)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        info = json.loads(proc.stdout.readline())
        assert info["address"] == f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        assert proc.wait(10) == 0  # SIGTERM: a clean stop
        proc.stdout.close()
    bad = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "store", "node"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--master" in bad.stderr
