"""The roofline report (bench/roofline.py, ``kvpool roofline``): the bytes and FLOPs a decode
step costs, which ceiling binds, the cached machine limits, and the command on the real model
(with the pool: where the KV came from)."""

import json

import pytest
import torch

from kvpool.bench import roofline as rl
from kvpool.model.kernels import kernels
from kvpool.model.kv_quant import row_width
from kvpool.model.linear import BlockLinear
from kvpool.model.llama import LlamaModel
from kvpool.model.machine import CURVE_BYTES


def limits(**kw):
    base = dict(cpu="test", threads=2, read_gbps=10.0, copy_gbps=8.0, gemm_gflops=50.0,
                block_gops={1: 20.0, 8: 40.0})  # fmt: skip
    return rl.MachineLimits(**{**base, **kw})


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_step_cost_counts_each_path_weights_and_the_kv(tiny_model, kv, monkeypatch):
    monkeypatch.setenv("KVPOOL_SMALL_ROWS", "2")
    fmt = "q4" if kernels() is not None else "float32"
    model = LlamaModel(tiny_model.config, tiny_model.weights, torch.float32, fmt, kv)
    c = model.cfg
    small, big = rl.step_cost(model, 1, 100), rl.step_cost(model, 4, 100)
    blocks = [lin for lin in model.linears() if isinstance(lin, BlockLinear)]
    if blocks:  # one row reads the blocks, four rows the float32 fallback
        assert small.weight_bytes == sum(lin.nbytes for lin in model.linears())
        assert big.weight_bytes == sum(lin.large.nbytes for lin in blocks)
        assert small.block_flops == small.flops - 4 * 100 * c.num_layers * c.num_heads * c.head_dim
        assert big.block_flops == 0
    elem = 1 if kv == "int8" else 4
    per_token = c.num_layers * 2 * c.num_kv_heads * row_width(c.head_dim, model.kv_dtype) * elem
    assert small.kv_bytes == 100 * per_token and big.kv_bytes == 4 * 100 * per_token


def test_analyze_finds_the_binding_ceiling():
    cost = rl.StepCost(weight_bytes=100_000_000, kv_bytes=0, flops=1e9, block_flops=0)
    row = rl.analyze(limits(), cost, batch=1, context=10, step_s=0.02)
    assert row.bandwidth_ceiling_tok_s == pytest.approx(100.0)  # 10 GB/s / 100 MB
    assert row.compute_ceiling_tok_s == pytest.approx(50.0)  # 50 GFLOP/s / 1 GFLOP
    assert row.bound == "compute" and row.share == pytest.approx(1.0)
    assert row.bandwidth_share == pytest.approx(0.5) and row.verdict == "compute"
    slow = rl.analyze(limits(gemm_gflops=1e6), cost, 1, 10, 0.05)
    assert slow.bound == "bandwidth" and slow.share == pytest.approx(0.2)
    assert slow.verdict == "neither (overhead)"
    assert limits().block_rate(4) == 20.0 and limits().block_rate(64) == 40.0


def test_the_bandwidth_ceiling_is_the_one_at_the_steps_bytes():
    # a working set that fits in the caches reads faster than memory: the ceiling follows
    curve = {16 << 20: 60.0, 64 << 20: 50.0, 256 << 20: 20.0}
    lim = limits(read_gbps=25.0, read_curve=curve)
    assert lim.read_ceiling(8 << 20) == 60.0  # below the curve: its first point
    assert lim.read_ceiling(40 << 20) == pytest.approx(55.0)  # between points: interpolated
    assert lim.read_ceiling(200 << 20) == pytest.approx(28.75)
    assert lim.read_ceiling(240 << 20) == 25.0  # the curve (22.5) below memory's: memory's
    assert lim.read_ceiling(1 << 30) == 25.0  # beyond the curve: memory
    assert limits().read_ceiling(1 << 20) == 10.0  # no curve measured: memory
    cost = rl.StepCost(weight_bytes=40 << 20, kv_bytes=0, flops=1.0, block_flops=0)
    row = rl.analyze(lim, cost, batch=1, context=10, step_s=(40 << 20) / 27.5e9)
    assert row.read_gbps == pytest.approx(55.0) and row.bound == "bandwidth"
    assert row.bandwidth_share == pytest.approx(0.5) and row.share == pytest.approx(0.5)
    assert row.memory_share == pytest.approx(27.5 / 25.0)
    # a probe measured beside the step wins over the curve, never below memory's
    assert rl.analyze(lim, cost, 1, 10, 0.01, read_gbps=30.0).read_gbps == 30.0
    assert rl.analyze(lim, cost, 1, 10, 0.01, read_gbps=5.0).read_gbps == 25.0


def test_machine_limits_are_measured_once_then_cached(tmp_path, monkeypatch):
    from kvpool.model import machine

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    assert machine.known_limits() is None  # a server never measures: nothing known yet
    calls = []
    monkeypatch.setattr(machine, "measure_machine", lambda k=None: calls.append(1) or limits())
    assert machine.machine_limits() == machine.machine_limits() == limits()
    assert len(calls) == 1
    machine.machine_limits(fresh=True)
    assert len(calls) == 2
    assert machine.known_limits() == limits()
    (tmp_path / "autotune" / "machine.json").write_text('{"x": 1}')  # another version
    assert machine.known_limits() is None


def test_measure_machine_gives_positive_figures():
    m = rl.measure_machine(kernels())
    assert m.read_gbps > 0 and m.copy_gbps > 0 and m.gemm_gflops > 0
    assert sorted(m.read_curve) == sorted(CURVE_BYTES)
    assert min(m.read_curve.values()) > 0
    if kernels() is not None:
        assert set(m.block_gops) >= {1, 64} and min(m.block_gops.values()) > 0


def test_plot_writes_a_png(tmp_path):
    cost = rl.StepCost(10_000_000, 1_000_000, 1e8, 0)
    rows = [rl.analyze(limits(), cost, b, 64, 0.01 * b**0.5) for b in (1, 2, 4)]
    rl.plot(rows, limits(), "test", tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_roofline_command_on_the_real_model_with_the_pool(tmp_path):
    import subprocess

    from support.procs import Proc, kvpool_cmd

    master = Proc("store", "master", "--port", "0", "--log-level", "warning")
    node = Proc("store", "node", "--master", master.info["address"], "--memory", "256MiB",
                "--node-id", "roofline-node", "--log-level", "warning")  # fmt: skip
    try:
        out = subprocess.run([*kvpool_cmd(), "roofline", "--batches", "1,2", "--context", "96",
                              "--new-tokens", "4", "--rounds", "2",
                              "--master", master.info["address"],
                              "--out", str(tmp_path)],
                             capture_output=True, text=True, timeout=900)  # fmt: skip
    finally:
        node.stop()
        master.stop()
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "roofline.json").read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    assert report["rounds"] == 2
    for r in report["rows"]:
        assert r["step_s"] > 0 and r["weight_mb"] > 0 and r["bound"] in ("bandwidth", "compute")
        # each round has its own bandwidth probe; of two, the row is the lower share's round
        shares = [x["share"] for x in r["rounds"]]
        assert len(shares) == 2 and all(x["read_gbps"] > 0 for x in r["rounds"])
        # each against the bandwidth at its step's bytes, never below memory's
        assert all(x["working_set_gbps"] >= x["read_gbps"] for x in r["rounds"])
        assert r["bandwidth_share"] <= r["memory_share"]
        assert r["share"] == min(shares)
        assert r["step_s"] == r["rounds"][shares.index(min(shares))]["step_s"]
    for s in report["kv_sources"]:  # the second pass read its prompts' blocks from the pool
        assert s["pool_tokens"] == s["batch"] * 80, s  # 5 full blocks usable per prompt
        assert s["pool_load_bytes"] > 0 and s["computed_tokens"] < s["prompt_tokens"]
        assert s["engine_tokens"] + s["pool_tokens"] + s["computed_tokens"] == s["prompt_tokens"]
    assert (tmp_path / "roofline.png").stat().st_size > 1000
    assert "share" in out.stdout and "bound" in out.stdout


def test_measure_decode_after_the_step_record_is_full(tiny_model):
    """The engine keeps its last 512 step times: once that record is full its length stops
    growing, and a measurement must still find the steps of its own call."""
    from kvpool.engine.llm import LLM

    llm = LLM(loaded_model=tiny_model, block_size=4, num_kv_blocks=256, max_num_seqs=4)
    try:
        times = llm.engine.step_times
        times.extend([(0, 2, 9.0)] * times.maxlen)  # full, of old steps of the same batch
        llm.engine.steps_recorded += times.maxlen
        step = rl.measure_decode(llm, batch=2, context=8, new_tokens=6)
        assert 0 < step < 9.0  # one of this call's decode steps, not an old record
        assert len(times) == times.maxlen
    finally:
        llm.engine.close()
