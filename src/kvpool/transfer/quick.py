"""The quick path of ``TransferEngine.transfer``: a small synchronous batch of one kind to one
peer, moved by the calling thread with the least bookkeeping (``Transport.exchange``)."""

from __future__ import annotations

import time

from kvpool.transfer.protocol import Op
from kvpool.transfer.request import State, TransferRequest, TransferStatus

QUICK_REQUESTS = 64  # a synchronous batch this small (and <= QUICK_BYTES) may take the quick path
QUICK_BYTES = 4 << 20


class QuickPath:
    """Mixed into ``TransferEngine`` (uses its ``_check``, ``_pick``, transports and stats)."""

    def _quick(
        self, requests: list[TransferRequest], timeout: float | None
    ) -> list[TransferStatus] | None:
        """A small synchronous batch of one kind (all READs or all WRITEs) to one peer, moved
        by this thread with the least bookkeeping: over an idle TCP connection it holds for
        the whole exchange, or by a shared-memory copy. None, with nothing moved, when the
        batch does not qualify or the transport cannot take it now (then the general path
        runs). Such a batch is never counted in flight: its caller is blocked on it."""
        if not 0 < len(requests) <= QUICK_REQUESTS or self._closed:
            return None
        views: dict[tuple[int, bool], memoryview] = {}
        items = [self._check(r, views) for r in requests]
        op, _, desc, _ = items[0]
        total = 0
        for kind, local, d, _ in items:
            if kind is not op or d.owner_id != desc.owner_id:
                return None
            total += len(local)
        if total > QUICK_BYTES:
            return None
        pick = self._picks.get((desc.name, self.config.transport))
        if pick is None:
            pick = self._picks[(desc.name, self.config.transport)] = self._pick(desc)
        started = time.monotonic()
        wait = timeout if timeout is not None else self.config.request_timeout
        errors = self._transports[pick].exchange(op, items, started + wait)
        if errors is None:
            return None
        elapsed = time.monotonic() - started
        direction = "read" if op is Op.READ else "write"
        statuses, done = [], []
        for (_, local, d, _), err in zip(items, errors, strict=True):
            if err is None:
                statuses.append(TransferStatus(State.DONE, len(local), None))
                done.append((pick, direction, len(local), elapsed, False))
            else:
                statuses.append(TransferStatus(State.FAILED, 0, err))
                self._count_failure(err, d.name)
        if done:
            self.stats.finished(done)
        return statuses
