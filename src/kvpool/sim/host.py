"""Nodes that share one host's cores (``host_cores``: the calibrated profile of a small
machine running every worker), as processor sharing.

Each node's step has a length measured alone (its work). While ``n`` nodes are stepping with
``threads`` threads each on ``cores`` cores, each advances at ``min(1, cores / (n *
threads))`` of its alone speed; whenever a step starts or ends, the others' remaining work is
brought up to date and their end events are moved (a moved event's old copy is stale: the
version it carries is one the host hands out once, so a later step of the same node never
matches an earlier step's stale event).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.events import EventLoop


class _Step:
    __slots__ = ("args", "done", "left", "version")

    def __init__(self, left: float, done: Callable, args: tuple) -> None:
        self.left, self.done, self.args, self.version = left, done, args, 0


class SharedHost:
    def __init__(self, loop: EventLoop, cores: float, threads: int) -> None:
        if cores <= 0 or threads < 1:
            raise ValueError("a host needs cores > 0 and threads >= 1")
        self.loop, self.cores, self.threads = loop, cores, threads
        self.steps: dict[object, _Step] = {}  # by node
        self.since = 0.0  # when the remaining work was last brought up to date
        self.versions = 0  # end events carry a version unique on this host

    def rate(self) -> float:
        n = len(self.steps)
        return min(1.0, self.cores / (n * self.threads)) if n else 1.0

    def run(self, node: object, work_s: float, done: Callable, *args) -> None:
        """``node`` steps for ``work_s`` seconds of its own; ``done(*args)`` when it ends."""
        assert node not in self.steps, "a node runs one step at a time"
        self._advance()
        self.steps[node] = _Step(work_s, done, args)
        self._reschedule()

    def _advance(self) -> None:
        now, rate = self.loop.now, self.rate()
        for s in self.steps.values():
            s.left = max(0.0, s.left - (now - self.since) * rate)
        self.since = now

    def _reschedule(self) -> None:
        rate = self.rate()
        for node, s in self.steps.items():
            self.versions += 1
            s.version = self.versions
            self.loop.after(s.left / rate, self._end, node, s.version)

    def _end(self, node: object, version: int) -> None:
        s = self.steps.get(node)
        if s is None or s.version != version:
            return  # moved since
        self._advance()
        del self.steps[node]
        self._reschedule()
        s.done(*s.args)
