"""Entry points' argument handling (the model-loading path is covered by tests/integration/e2e)."""

from __future__ import annotations

import pytest

from kvpool import cli
from kvpool.common.net import is_loopback
from kvpool.entrypoints import common, serve


def test_non_loopback_without_token_is_refused(monkeypatch, capsys):
    monkeypatch.delenv(common.AUTH_ENV, raising=False)
    monkeypatch.setattr(serve, "_start_engine", lambda _c: pytest.fail("must not load"))
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "KVPOOL_AUTH_TOKEN" in err and "0.0.0.0" in err


def test_invalid_config_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(serve, "_start_engine", lambda _c: pytest.fail("must not load"))
    assert cli.main(["serve", "--kv-cache-memory", "lots"]) == 2
    assert "invalid configuration" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("example.com", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_flags_and_served_name():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--model",
            "/m/Foo-1B.gguf",
            "--dtype",
            "bfloat16",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "512MiB",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--max-model-len",
            "1024",
            "--no-prefix-caching",
        ]
    )
    assert common.served_name(args) == "Foo-1B"
    cfg = common.engine_config(args)
    assert (cfg.dtype, cfg.block_size, cfg.kv_cache_memory_bytes) == ("bfloat16", 32, 2**29)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (8, 512, 1024)
    assert cfg.enable_prefix_caching is False
    default = cli.build_parser().parse_args(["serve"])
    assert (default.host, default.port) == ("127.0.0.1", 8000)
    assert common.served_name(default) == "SmolLM2-135M-Instruct"
    named = cli.build_parser().parse_args(["serve", "--served-model-name", "x"])
    assert common.served_name(named) == "x"


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_export_hf_calls_the_loader(monkeypatch, tmp_path, capsys):
    from kvpool.model import loader

    calls = []
    monkeypatch.setattr(loader, "export_hf", lambda model, out: calls.append((model, out)) or out)
    assert cli.main(["export-hf", "--model", "m.gguf", "--out", str(tmp_path)]) == 0
    assert calls == [("m.gguf", str(tmp_path))]
    assert str(tmp_path) in capsys.readouterr().out


def test_cluster_config_file_fills_defaults_and_the_command_line_wins(tmp_path):
    from kvpool.entrypoints.launcher import plan

    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("prefill: 2\nstore-memory: 2GiB\npolicy: least_load\nprefill_chunk: 64\n")
    args = cli.build_parser().parse_args(["serve", "--config", str(cfg), "--prefill", "3"])
    serve.apply_config_file(args)
    assert args.prefill == 3  # the command line wins
    assert (args.store_memory, args.policy, args.prefill_chunk) == ("2GiB", "least_load", 64)
    pool, workers = plan(serve.cluster_config(args))
    assert [c.name for c in pool] == ["store-master", "store-node"]
    assert [w.name for w in workers] == ["prefill-1", "prefill-2", "prefill-3", "decode-1"]
    # each child gets a config, not flags: the prefill chunk for prefill workers, the decode
    # chunk (default 256) for decode workers
    assert workers[0].config.engine.max_num_batched_tokens == 64
    assert workers[-1].config.engine.max_num_batched_tokens == 256
    unchunked = cli.build_parser().parse_args(["serve", "--decode-chunk", "0"])
    _, workers2 = plan(serve.cluster_config(unchunked))
    assert workers2[-1].config.engine.max_num_batched_tokens == 2048  # the engine's own
    assert {w.config.role for w in workers} == {"prefill", "decode"}
    assert pool[1].config.memory == 2 << 30
    colocated = cli.build_parser().parse_args(["serve", "--colocated", "2"])
    pool, workers = plan(serve.cluster_config(colocated))
    assert pool == [] and [w.name for w in workers] == ["both-1", "both-2"]
    assert all(w.config.store is None for w in workers)
    args = cli.build_parser().parse_args(["serve", "--decode-threads", "2", "--threads", "1"])
    _, workers = plan(serve.cluster_config(args))
    assert [(w.config.role, w.config.engine.num_threads) for w in workers] == [
        ("prefill", 1), ("decode", 2)]  # fmt: skip


def test_configs_cross_processes_as_plain_data():
    """What the launcher sends its children: every config round-trips through JSON, and a
    bad or unknown setting is a ValueError naming it (a child then exits 2)."""
    import json

    from kvpool.config import (
        ClusterConfig,
        ConductorConfig,
        EngineConfig,
        NodeConfig,
        WorkerConfig,  # fmt: skip
        from_wire,
        to_wire,
    )

    for cfg in (WorkerConfig(role="prefill", engine=EngineConfig(block_size=8)),
                NodeConfig(master="127.0.0.1:1", memory="2GiB"),
                ConductorConfig(workers=["127.0.0.1:2"], policy="least_load"),
                ClusterConfig(prefill=2, store_memory="64MiB")):  # fmt: skip
        assert from_wire(type(cfg), json.loads(json.dumps(to_wire(cfg)))) == cfg
    with pytest.raises(ValueError, match="unknown setting"):
        from_wire(WorkerConfig, {"rol": "prefill"})
    with pytest.raises(ValueError, match="block_size"):
        from_wire(WorkerConfig, {"engine": {"block_size": 0}})
    with pytest.raises(ValueError, match="role"):
        from_wire(WorkerConfig, {"role": "router"})
    with pytest.raises(ValueError, match="mapping"):
        from_wire(NodeConfig, ["memory", "1GiB"])


def test_a_worker_refuses_a_bad_config_on_stdin(monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO('{"role": "router"}'))
    assert cli.main(["worker", "--config-json", "-"]) == 2
    assert "role must be one of" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO('{"memory": "lots"}'))
    assert cli.main(["store", "node", "--config-json", "-"]) == 2
    assert "cannot parse size" in capsys.readouterr().err


def test_cluster_config_file_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefil: 2\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    assert "unknown setting 'prefil'" in capsys.readouterr().err
    assert cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert cli.main(["serve", "--prefill", "0", "--decode", "0"]) == 2


def test_served_name_follows_the_model_path():
    assert common.served_name_of(None) == common.DEFAULT_SERVED_NAME
    assert common.served_name_of("/m/Qwen2-0.5B.Q8_0.gguf") == "Qwen2-0.5B.Q8_0"
    assert common.served_name_of("/models/llama-folder") == "llama-folder"
