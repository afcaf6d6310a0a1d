"""A toy profile whose step costs are easy to write down by hand (not a conftest.py: test
modules elsewhere import the root conftest by name)."""

from __future__ import annotations

from kvpool.sim.profile import ModelSpec, NetworkSpec, NodeSpec, PoolSpec, Profile
from kvpool.sim.workload import SimRequest

# per token through the layers: 2 * 112 weights = 224 FLOPs; LM head 2 * 4 * 28 = 224 FLOPs;
# one causal (query, key) pair: 4 * 1 layer * 1 head * 4 = 16 FLOPs; KV: 2 * 4 * 1 = 8 bytes
TOY_MODEL = ModelSpec("toy", num_layers=1, hidden_size=4, intermediate_size=4, num_heads=1,
                      num_kv_heads=1, head_dim=4, vocab_size=28, kv_dtype_bytes=1,
                      weight_bytes=1000)  # fmt: skip
LIN = 0.001  # s per token (224 FLOPs at 224,000 FLOP/s)
HEAD = 0.001  # s per logits row
PAIR = 16 / 224_000  # s per causal pair
WEIGHTS = 0.001  # s per step (1000 B at 1 MB/s)
KV = 8e-6  # s per context token read
BASE = 0.01  # s per step
LINK = 8000.0  # bytes/s: one token's KV (8 B) in 1 ms
OVERHEAD = 0.002  # s per transfer


def toy_profile(**node) -> Profile:
    spec = {"flops_per_s": 224_000, "mfu": 1.0, "mem_bytes_per_s": 1e6, "mem_efficiency": 1.0,
            "overlap": False, "step_base_s": BASE, "max_batch": 8, "max_batched_tokens": 64,
            "colocated_chunk_tokens": 16, "kv_capacity_tokens": 10_000,
            "local_cache_blocks": 100, **node}  # fmt: skip
    return Profile("toy", TOY_MODEL, NodeSpec(**spec), NetworkSpec(LINK, OVERHEAD),
                   PoolSpec(blocks_per_node=100, nodes=1), block_tokens=4)  # fmt: skip


def step(prefill=0, pairs=0, context=0, logits=0, decodes=0, decode_context=0) -> float:
    """The toy's step time written out (overlap off: compute + memory)."""
    compute = LIN * (prefill + decodes) + HEAD * logits + PAIR * (pairs + decode_context)
    memory = WEIGHTS + KV * (context + decode_context)
    return BASE + compute + memory


def hashes(*names: str) -> tuple[bytes, ...]:
    return tuple(n.encode().ljust(8, b"_") for n in names)


def request(index, arrival, n_in, n_out, *blocks) -> SimRequest:
    return SimRequest(index, arrival, n_in, n_out, hashes(*blocks))
