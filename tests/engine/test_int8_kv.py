"""int8 KV blocks end to end on the tiny model: the engine computes with them, the pool stores
and moves them as they are (a fraction of float32's bytes), and engines with float KV never
read them (another namespace)."""

import pytest
import torch

from kvpool import SamplingParams
from kvpool.engine.connectors.store import StoreConnector
from kvpool.model.kernels import kernels
from kvpool.store.embedded import EmbeddedStore

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(eng, prompt, rid="r"):
    eng.add_request(rid, prompt, SP)
    outs = []
    while eng.has_unfinished_requests():
        outs = eng.step() or outs
    return outs[-1]


@pytest.fixture
def pool():
    with EmbeddedStore(memory="64MiB") as store:
        yield store


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("use_kernels", [True, False])  # the C++ path and gather + SDPA
def test_int8_cache_answers_like_float_cache(tiny_engine_factory, use_kernels):
    if use_kernels and kernels() is None:
        pytest.skip("no C++ compiler for the kernels")
    prompts = [prompt_of(s, n) for s, n in ((1, 9), (2, 30), (3, 50))]
    outs = {}
    for kv in ("auto", "int8"):
        eng = tiny_engine_factory(kv_cache_dtype=kv, use_kernels=use_kernels, weights="float32")
        assert eng.kv_cache.dtype == (torch.int8 if kv == "int8" else torch.float32)
        outs[kv] = [run(eng, p, str(i)).outputs[0].token_ids for i, p in enumerate(prompts)]
    same = sum(a == b for x, y in zip(outs["auto"], outs["int8"], strict=True)
               for a, b in zip(x, y, strict=True))  # fmt: skip
    assert same >= 0.8 * 3 * 6, outs  # random tiny weights: close, not always equal


def test_pool_moves_int8_blocks_as_they_are(pool, tiny_engine_factory):
    prompt = prompt_of(7, 41)
    a_conn = StoreConnector(pool)
    a = tiny_engine_factory(connector=a_conn, kv_cache_dtype="int8")
    cold = run(a, prompt).outputs[0].token_ids
    assert a_conn.wait_saved(a.pool.cached_hashes(), timeout=10)
    a.close()
    c = a.model_config
    assert a_conn.block_bytes == c.num_layers * 2 * 4 * c.num_kv_heads * (c.head_dim + 4)
    float_bytes = c.num_layers * 2 * 4 * c.num_kv_heads * c.head_dim * 4
    assert a_conn.block_bytes / float_bytes == pytest.approx((c.head_dim + 4) / (4 * c.head_dim))

    b_conn = StoreConnector(pool)
    b = tiny_engine_factory(connector=b_conn, kv_cache_dtype="int8")
    out = run(b, prompt)
    b.close()
    assert out.outputs[0].token_ids == cold
    assert b_conn.stats.loaded_blocks == 10
    assert b_conn.stats.loaded_bytes == 10 * a_conn.block_bytes

    f_conn = StoreConnector(pool)  # float KV: another namespace, nothing to load
    f = tiny_engine_factory(connector=f_conn)
    assert f.namespace != b.namespace
    run(f, prompt)
    f.close()
    assert f_conn.stats.loaded_blocks == 0
