"""``kvpool bench compare``'s vLLM presets: refused with a reason when vLLM's python is not
given (the presets themselves run in ``tests/integrations/vllm/test_vllm_conductor.py``,
through the same ``VllmCluster``)."""

from __future__ import annotations

import argparse

import pytest

from kvpool.bench.vllm_launch import VLLM_PRESETS, VllmServer
from kvpool.conductor.vllm import VllmSpec
from kvpool.entrypoints.bench import add_parser, run_compare


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpool")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "compare", "--trace", "none.jsonl", "--out", "o", *argv])


def test_vllm_presets_need_vllms_python(monkeypatch, capsys):
    monkeypatch.delenv("KVPOOL_VLLM_PYTHON", raising=False)
    assert run_compare(parse("--configs", "disaggregated,vllm-pool")) == 2
    assert "--vllm-python" in capsys.readouterr().err
    assert run_compare(parse("--configs", "vllm-nope")) == 2
    assert "vllm-disaggregated" in capsys.readouterr().err  # the known configs are listed


@pytest.mark.parametrize("name", sorted(VLLM_PRESETS))
def test_presets_are_consistent(name):
    preset = VLLM_PRESETS[name]
    assert preset["servers"] >= 1
    assert len(preset.get("roles", ["both"] * preset["servers"])) == preset["servers"]
    assert preset["pool"] or preset["servers"] == 1  # no conductor without the pool


def test_a_launched_servers_spec_is_what_the_conductor_parses(tmp_path):
    server = VllmServer("python", "model", tmp_path, events="ipc:///tmp/e.pub",
                        replay="ipc:///tmp/e.replay")  # fmt: skip
    server.port = 8123
    spec = VllmSpec.parse(server.spec("prefill"))
    assert spec == VllmSpec("127.0.0.1:8123", "prefill", "ipc:///tmp/e.pub", "ipc:///tmp/e.replay")
