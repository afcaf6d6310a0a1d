"""Small network helpers shared by every server."""

from __future__ import annotations

import functools
import ipaddress
import select
import socket
import time


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_matches(host: str, peer: str) -> bool:
    """Whether a descriptor naming ``host`` may come from ``peer`` (an IP address): ``host``
    resolves to ``peer``, or ``peer`` is this host (loopback) and ``host`` is one of its own."""
    addresses = _resolve(host)
    if peer in addresses:
        return True
    return is_loopback(peer) and bool(addresses) and all(map(_is_local, addresses))


def _resolve(host: str) -> frozenset[str]:
    try:
        return frozenset({str(ipaddress.ip_address(host))})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return frozenset()
    return frozenset(str(info[4][0]) for info in infos)


@functools.lru_cache(maxsize=256)
def _is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this host (it can be bound)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
    except OSError:
        return False
    return True


def spin_until_readable(sock: socket.socket, seconds: float) -> None:
    """Poll ``sock`` (GIL released in each poll) for up to ``seconds`` before the caller blocks
    on it: a reply arriving within that window is taken at once, by a thread whose CPU never
    went idle, rather than after a sleep and a wake-up (tens to hundreds of microseconds on a
    virtual machine). Mooncake Store's client waits for its transfers the same way."""
    if seconds <= 0:
        return
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    end = time.perf_counter() + seconds
    while not poller.poll(0) and time.perf_counter() < end:
        pass
