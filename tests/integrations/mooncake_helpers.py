"""Constants and values shared by the Mooncake adapter's tests."""

from __future__ import annotations

import numpy as np

MiB = 1 << 20
LEASE_TTL = 0.5  # the test master's read lease, seconds
NOT_FOUND, HAS_LEASE, INVALID, NOT_READY, STATE = -704, -706, -600, -703, -1010


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + n).bytes(n)
