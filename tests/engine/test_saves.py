"""The connector's background saves: batched, reported done, waited for, and never lost to
a write that raises."""

from __future__ import annotations

import threading

from kvpool.engine.connectors.base import BlockRef
from kvpool.engine.connectors.saves import Saver


def ref(i: int) -> BlockRef:
    return BlockRef(block_id=i, block_hash=bytes([i]) * 16, token_ids=(i,))


def test_saves_are_batched_reported_and_waited_for():
    gate, batches = threading.Event(), []

    def write(refs):
        gate.wait(10)
        batches.append([r.block_id for r in refs])

    saver = Saver(write).start()
    try:
        saver.save([ref(1)])
        saver.save([ref(2), ref(3)])  # queued while the first write waits: one batch
        assert not saver.wait_saved([ref(3).block_hash], 0.05)
        gate.set()
        assert saver.wait_saved([ref(1).block_hash, ref(3).block_hash], 10)
        done = saver.poll_saved()
        assert sorted(done) == [1, 2, 3] and saver.poll_saved() == []
        assert len(batches) <= 2 and sorted(b for batch in batches for b in batch) == [1, 2, 3]
    finally:
        saver.close()


def test_a_write_that_raises_still_reports_its_blocks_and_the_thread_goes_on():
    calls = []

    def write(refs):
        calls.append(len(refs))
        if len(calls) == 1:
            raise RuntimeError("disk on fire")

    waits = []
    saver = Saver(write, waits.append).start()
    try:
        saver.save([ref(1)])
        assert saver.wait_saved([ref(1).block_hash], 10)
        saver.save([ref(2)])
        assert saver.wait_saved([ref(2).block_hash], 10)
        assert sorted(saver.poll_saved()) == [1, 2] and calls == [1, 1]
        assert len(waits) == 2 and all(w >= 0 for w in waits)
    finally:
        saver.close()
