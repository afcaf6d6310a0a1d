"""What the conductor knows about the cluster: plain snapshots the routing policies read.

Policies are pure functions of a :class:`ClusterSnapshot` and a :class:`RequestInfo`, so a
simulator can drive them with made-up snapshots (DESIGN.md §4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.protocol.worker import CostModel

BACKLOG_WINDOW_S = 1.5  # time constant of ``WorkerLoad.backlogged``


def decay_backlog(prev: float, busy: bool, dt: float) -> float:
    """``WorkerLoad.backlogged`` ``dt`` seconds after ``prev``, the queue ``busy`` meanwhile."""
    keep = math.exp(-max(dt, 0.0) / BACKLOG_WINDOW_S)
    return prev * keep + (1.0 - keep) * busy


@dataclass(slots=True)
class WorkerLoad:
    """What a worker reports about its queue (and the conductor adds about requests it sent)."""

    queued_prefill_tokens: int = 0  # prompt tokens admitted or waiting, not yet computed
    running: int = 0  # requests decoding
    waiting: int = 0
    kv_usage: float = 0.0
    remaining_tokens: list[int] = field(default_factory=list)  # per running request
    inflight: int = 0  # requests the conductor routed here that it has not seen finish
    # the share of the last seconds its prefill queue was non-empty, as the conductor saw it
    # (a moving average, BACKLOG_WINDOW_S): near 1 under sustained load, not after a burst
    backlogged: float = 0.0

    def to_dict(self) -> dict:
        return {
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": round(self.kv_usage, 4),
            "inflight": self.inflight,
            "backlogged": round(self.backlogged, 3),
        }


@dataclass(slots=True)
class WorkerView:
    """One worker as the policies see it."""

    id: str
    role: str
    address: str  # its OpenAI HTTP endpoint, host:port
    rpc: str  # its control RPC, host:port
    load: WorkerLoad = field(default_factory=WorkerLoad)
    cost: CostModel = field(default_factory=CostModel)
    cached: frozenset[bytes] | set[bytes] = frozenset()  # block hashes in its local cache
    alive: bool = True
    engine: str = "kvpool"  # or "vllm": a vLLM server behind the conductor
    step_tokens: int = 0  # tokens its engine steps at most (a prompt's chunk; 0: unknown)

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    def local_prefix_blocks(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def queue_s(self) -> float:
        """Time until this worker can start a new prefill."""
        q = self.load.queued_prefill_tokens
        return self.cost.prefill_s(q) if q else 0.0


@dataclass(slots=True)
class ClusterSnapshot:
    workers: list[WorkerView]
    pool_bytes_per_s: float = 2e9  # measured pool -> engine load bandwidth
    block_bytes: int = 0  # bytes of one KV block
    pool_up: bool = True

    def alive(self, pred) -> list[WorkerView]:
        return [w for w in self.workers if w.alive and pred(w)]


@dataclass(slots=True, frozen=True)
class RequestInfo:
    num_prompt_tokens: int
    block_hashes: tuple[bytes, ...]  # of the prompt's full blocks
    block_size: int
    max_tokens: int = 16
    pool_prefix_blocks: int = 0  # leading blocks present in the pool


@dataclass(slots=True, frozen=True)
class Placement:
    """A policy's answer for one side (prefill or decode)."""

    worker_id: str
    predicted_s: float  # TTFT for prefill, TBT for decode
    local_blocks: int = 0
    pool_blocks: int = 0
