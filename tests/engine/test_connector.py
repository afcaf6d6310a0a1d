"""The KV connector seam: blocks saved by one engine are loaded by another."""

import threading

import torch

from kvpool import SamplingParams
from kvpool.engine.connectors.base import BlockRef, KVConnector


class DictConnector(KVConnector):
    """Unit-test seam: keeps block bytes in a dict; saves on a background thread."""

    def __init__(self, store=None):
        self.store = {} if store is None else store
        self.saved: list[int] = []
        self.loaded = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def bind(self, kv_cache, block_size, namespace):
        super().bind(kv_cache, block_size, namespace)
        self.kv = kv_cache

    def num_loadable_blocks(self, block_hashes, start):
        n = 0
        for h in block_hashes[start:]:
            if h not in self.store:
                break
            n += 1
        return n

    def load(self, blocks, block_ids):
        for i, (ref, bid) in enumerate(zip(blocks, block_ids, strict=True)):
            toks, data = self.store[ref.block_hash]
            if toks != ref.token_ids:
                return i
            self.kv[bid].copy_(data)
            self.loaded += 1
        return len(blocks)

    @property
    def saves(self):
        return True

    def save(self, blocks: list[BlockRef]):
        copies = [(b, self.kv[b.block_id].clone()) for b in blocks]  # snapshot, then hand off

        def work():
            with self._lock:
                for b, data in copies:
                    self.store[b.block_hash] = (b.token_ids, data)
                    self.saved.append(b.block_id)

        t = threading.Thread(target=work)
        t.start()
        self._threads.append(t)

    def poll_saved(self):
        with self._lock:
            out, self.saved = self.saved, []
        return out

    def close(self):
        for t in self._threads:
            t.join()


def generate_one(eng, prompt, sp):
    """Run one request to completion; its final output."""
    eng.add_request("r", prompt, sp)
    while eng.has_unfinished_requests():
        outs = eng.step()
    return outs[0]


def test_blocks_saved_by_one_engine_are_loaded_by_another(tiny_engine_factory):
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (41,), generator=g).tolist()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    a_conn = DictConnector()
    a = tiny_engine_factory(connector=a_conn)
    cold = generate_one(a, prompt, sp).outputs[0].token_ids
    a.close()
    a._release_saved()
    assert len(a_conn.store) >= 10  # 41 prompt + 7 decoded tokens: 12 full blocks of 4
    assert not a._saving  # every saved block's reference was given back
    assert a.pool.usage() == 0

    b_conn = DictConnector(a_conn.store)
    b = tiny_engine_factory(connector=b_conn)
    out = generate_one(b, prompt, sp)
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 40  # 10 blocks; the last token is always computed
    assert b_conn.loaded == 10
    assert b.stats().external_prefix_hits == 40


def test_corrupt_external_block_is_a_miss(tiny_engine_factory):
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 256, (20,), generator=g).tolist()
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    conn = DictConnector()
    a = tiny_engine_factory(connector=conn)
    cold = generate_one(a, prompt, sp).outputs[0].token_ids
    a.close()
    # Forge block 2's stored tokens: the loader must stop there and compute the rest.
    keys = list(conn.store)  # insertion order = block order
    toks, data = conn.store[keys[2]]
    conn.store[keys[2]] = ((-1, *toks[1:]), data)
    out = generate_one(tiny_engine_factory(connector=DictConnector(conn.store)), prompt, sp)
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 8
