"""Direct prefill-to-decode reads over real transfer engines and TCP: a decode engine given a
prefill engine's KV handle reads the prompt's blocks straight from it (its byte counter
moves, the pool is not even asked), and falls back to the pool when the blocks were reused
or the prefill side is gone; the tokens always equal a cold run's."""

from __future__ import annotations

import pytest
import torch

from kvpool import SamplingParams
from kvpool.common.hashing import block_hashes
from kvpool.config import TransferConfig
from kvpool.engine.connectors.store import StoreConnector
from kvpool.protocol.decode import KVHandle
from kvpool.store import StoreClient
from kvpool.store.embedded import EmbeddedStore

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def pool():
    with EmbeddedStore(memory="64MiB") as store:
        yield store


def client_of(pool) -> StoreClient:
    """A client with its own transfer engine (another process's, as far as bytes go)."""
    return StoreClient(pool.server.address, TransferConfig(transport="tcp"))


def run(eng, prompt, rid="r", kv_handle=None, params=SP):
    eng.add_request(rid, prompt, params, kv_handle=kv_handle)
    outs = []
    while eng.has_unfinished_requests():
        outs = eng.step() or outs
    return outs[-1]


def prompt_of(seed: int, n: int = 41) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(pool, tiny_engine_factory, prompt):
    """A prefill engine on its own client: its cold output, its handle, its client."""
    client = client_of(pool)
    conn = StoreConnector(client)
    eng = tiny_engine_factory(connector=conn)
    cold = run(eng, prompt, "prefill").outputs[0].token_ids
    hashes = block_hashes(prompt, 4, eng.kv_manager.hash_seed)
    assert conn.wait_saved(hashes, 10)
    handle = conn.kv_handle(hashes)
    assert handle is not None and len(handle.blocks) == 10
    assert KVHandle.from_wire(handle.to_wire()) == handle  # what crosses the RPC
    return eng, conn, client, cold, handle


@pytest.fixture
def decode(pool, tiny_engine_factory):
    """A decode engine on its own client: (engine, connector)."""
    client = client_of(pool)
    conn = StoreConnector(client)
    yield tiny_engine_factory(connector=conn), conn
    client.close()


def test_decode_reads_the_prefill_engines_blocks_directly(pool, tiny_engine_factory, decode):
    prompt = prompt_of(1)
    a, _, a_client, cold, handle = prefill(pool, tiny_engine_factory, prompt)
    b, b_conn = decode
    out = run(b, prompt, kv_handle=handle)
    assert out.outputs[0].token_ids == cold and out.num_cached_tokens == 40
    assert b_conn.direct.read_blocks == 10
    assert b_conn.direct.read_bytes == 10 * b_conn.block_bytes
    assert b_conn.stats.lookups == 0  # the handle was the lookup: no master round trip
    assert b_conn.direct.fallbacks == 0
    a.close()
    a_client.close()


def test_reused_blocks_are_read_from_the_pool(pool, tiny_engine_factory, decode):
    prompt = prompt_of(2)
    a, _, a_client, cold, handle = prefill(pool, tiny_engine_factory, prompt)
    a.reset_prefix_cache()
    for i in range(6):  # other prompts take (and overwrite) every free block
        run(a, prompt_of(100 + i, 80), f"other{i}")
    b, b_conn = decode
    out = run(b, prompt, kv_handle=handle)
    assert out.outputs[0].token_ids == cold and out.num_cached_tokens == 40
    assert b_conn.direct.fallbacks == 1 and b_conn.direct.read_blocks < 10
    assert b_conn.stats.loaded_blocks == 10  # the rest came from the pool
    a.close()
    a_client.close()


def test_a_dead_prefill_worker_falls_back_to_the_pool(pool, tiny_engine_factory, decode):
    prompt = prompt_of(3)
    a, _, a_client, cold, handle = prefill(pool, tiny_engine_factory, prompt)
    a.close()
    a_client.close()  # its transfer server and segment are gone
    b, b_conn = decode
    out = run(b, prompt, kv_handle=handle)
    assert out.outputs[0].token_ids == cold and out.num_cached_tokens == 40
    assert b_conn.direct.read_blocks == 0 and b_conn.direct.fallbacks == 1
    assert b_conn.stats.loaded_blocks == 10


def test_a_handle_for_other_tokens_is_not_used(pool, tiny_engine_factory, decode):
    a, _, a_client, _, handle = prefill(pool, tiny_engine_factory, prompt_of(4))
    b, b_conn = decode
    run(b, prompt_of(5), kv_handle=handle)
    assert b_conn.direct.read_blocks == 0 and b_conn.direct.fallbacks == 0
    a.close()
    a_client.close()


def go_on(eng, rid, ids, handle):
    """A decode worker going on from a prompt and its first token (5 more tokens)."""
    return run(eng, ids, rid, handle, SamplingParams(temperature=0, max_tokens=5,
                                                     ignore_eos=True))  # fmt: skip


def test_a_hand_off_reads_the_prompts_partial_last_block_too(pool, tiny_engine_factory, decode):
    # as a prefill worker hands off: the prompt (41 tokens: 10 blocks of 4 and one token) with
    # one new token; the decode engine goes on from prompt + that token and computes only that
    # token: the partial block comes from the prefill engine, checked against this prompt
    prompt = prompt_of(6)
    client = client_of(pool)
    conn = StoreConnector(client)
    a = tiny_engine_factory(connector=conn)
    cold = run(a, prompt, "cold").outputs[0].token_ids
    a.reset_prefix_cache()
    conn.expect_tail("handoff")
    a.add_request("handoff", prompt, SamplingParams(temperature=0, max_tokens=1))
    while a.has_unfinished_requests():
        first = a.step() or None
        if first:
            t1 = first[0].outputs[0].token_ids[0]
    hashes = block_hashes(prompt, 4, a.kv_manager.hash_seed)
    assert conn.wait_saved(hashes, 10)
    handle = conn.kv_handle(hashes, conn.take_tail("handoff"))
    assert handle.tail is not None and (handle.tail.index, handle.tail.tokens) == (10, 1)
    assert KVHandle.from_wire(handle.to_wire()) == handle
    assert t1 == cold[0]
    b, b_conn = decode
    out = go_on(b, "d", [*prompt, t1], handle)
    assert out.outputs[0].token_ids == cold[1:]
    assert out.num_cached_tokens == 41  # the whole prompt; only the first token computed
    assert b_conn.direct.tail_reads == 1 and b_conn.direct.tail_misses == 0
    # the same hand-off after the prefill engine reused that block: checked, then computed
    b.reset_prefix_cache()
    for i in range(6):
        run(a, prompt_of(200 + i, 80), f"other{i}")
    out = go_on(b, "d2", [*prompt, t1], handle)
    assert out.outputs[0].token_ids == cold[1:]
    assert b_conn.direct.tail_misses == 1 and out.num_cached_tokens <= 40
    a.close()
    client.close()
