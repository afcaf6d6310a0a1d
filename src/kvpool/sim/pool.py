"""The shared KV pool, modeled by the store master's own state machine.

``MasterState`` is pure logic with an injected clock, so the simulator drives the real code:
placement on the pool nodes' DRAM segments, two-phase puts, read leases (a lookup or a load
protects a block for ``lease_ttl`` seconds), and eviction from the high watermark down to the
low one, coldest first by decayed access frequency. Every block is one object of ``UNIT``
bytes in the master's books (the allocator's alignment: equal sizes evict exactly as the real
block bytes would, and no byte limit of the real store gets in the way).

The pool's nodes are booked as one DRAM segment of their total capacity (``nodes *
blocks_per_node`` blocks): with one replica per block and blocks of one size, spreading them
over several segments changes neither what fits nor what is evicted (the master's usage,
watermarks and eviction order are over the whole tier), and one segment keeps each put from
sorting every node (the real master's placement cost, which a simulation of hundreds of
thousands of puts does not need to pay).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.common.errors import BackpressureError, NoSpaceError
from kvpool.config import MasterConfig
from kvpool.store.master.objects import ObjectState, Tier
from kvpool.store.master.state import MasterState

UNIT = 64


class PoolModel:
    __slots__ = ("_beat", "clock", "count", "keys", "load_blocks", "lookups", "nodes",
                 "put_failures", "puts", "state")  # fmt: skip

    def __init__(self, nodes: int, blocks_per_node: int, clock: Callable[[], float],
                 config: MasterConfig | None = None) -> None:  # fmt: skip
        if nodes < 1 or blocks_per_node < 1:
            raise ValueError("a pool needs >= 1 node of >= 1 block")
        self.clock = clock
        self.state = MasterState(config or MasterConfig(), clock)
        self.nodes = ["pool"]
        self.state.mount("pool", "pool/dram", Tier.DRAM, nodes * blocks_per_node * UNIT)
        self.count = nodes
        self.keys: dict[bytes, str] = {}
        self._beat = clock()
        self.puts = self.put_failures = self.lookups = self.load_blocks = 0

    def key(self, h: bytes) -> str:
        k = self.keys.get(h)
        if k is None:
            k = self.keys[h] = "kv/" + h.hex()
        return k

    def _heartbeat(self) -> None:
        """The pool nodes are alive (else the master would suspect them after a few seconds)."""
        now = self.clock()
        if now - self._beat >= 1.0:
            for n in self.nodes:
                self.state.heartbeat(n)
            self._beat = now

    def prefix(self, hashes: tuple[bytes, ...]) -> int:
        """Leading blocks the pool holds, asked as the conductor asks (``batch_exists`` of the
        whole chain: every present block gets a read lease)."""
        self.lookups += 1
        exists = self.state.exists
        n, leading = 0, True
        for h in hashes:
            if exists(self.key(h)):
                n += leading
            else:
                leading = False
        return n

    def peek(self, hashes: tuple[bytes, ...]) -> int:
        """Leading blocks present, without leases (the simulator's own bookkeeping)."""
        objects, n = self.state.objects, 0
        for h in hashes:
            m = objects.get(self.key(h))
            if m is None or m.state is not ObjectState.COMPLETE or not m.replicas:
                break
            n += 1
        return n

    def load(self, hashes: tuple[bytes, ...]) -> int:
        """Read these blocks (``get``: a lease and an access each); how many leading ones were
        there to read."""
        get, n = self.state.get, 0
        for h in hashes:
            try:
                get(self.key(h))
            except KeyError:  # NotFoundError: evicted since the lookup
                break
            n += 1
        self.load_blocks += n
        return n

    def publish(self, hashes: tuple[bytes, ...]) -> None:
        """Put the blocks the pool does not hold (a put of a held key is refused as the real
        connector's is: the block is already there)."""
        self._heartbeat()
        st, objects = self.state, self.state.objects
        for h in hashes:
            key = self.key(h)
            if key in objects:
                continue
            try:
                meta = st.put_start(key, UNIT)
            except (NoSpaceError, BackpressureError):  # every block leased: this one is lost
                self.put_failures += 1
                continue
            st.put_end(key, meta.put_id, 0)
            self.puts += 1

    @property
    def used_blocks(self) -> int:
        return self.state.usage(Tier.DRAM)[0] // UNIT

    @property
    def evictions(self) -> int:
        return self.state.counters["evictions"]

    def stats(self) -> dict:
        used, cap = self.state.usage(Tier.DRAM)
        return {"pool_nodes": self.count, "pool_capacity_blocks": cap // UNIT,
                "pool_used_blocks": used // UNIT, "pool_puts": self.puts,
                "pool_put_failures": self.put_failures, "pool_evictions": self.evictions,
                "pool_lookups": self.lookups, "pool_loaded_blocks": self.load_blocks}  # fmt: skip
