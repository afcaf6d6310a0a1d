"""Free ports for the servers tests start."""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A free 127.0.0.1 port *below* the ephemeral range: a port the kernel picked for us
    (bind to 0) can be picked again for any process's ``bind(0)`` before our server binds it
    (a transfer server took a conductor's port that way, and the suite's health checks hit
    it); ports the kernel never hands out by itself cannot be taken like that."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")
