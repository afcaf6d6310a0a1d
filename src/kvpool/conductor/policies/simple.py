"""Baselines: random, round-robin and least-load routing (cache-blind)."""

from __future__ import annotations

import random

from kvpool.conductor.cluster_state import ClusterSnapshot, Placement, RequestInfo, WorkerView
from kvpool.conductor.policies.base import Policy, by_id, predicted_tbt, predicted_ttft


def _prefillers(snap: ClusterSnapshot) -> list[WorkerView]:
    return by_id(snap.alive(lambda w: w.prefills))


def _decoders(snap: ClusterSnapshot) -> list[WorkerView]:
    return by_id(snap.alive(lambda w: w.role == "decode"))


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose_prefill(self, snap: ClusterSnapshot, req: RequestInfo) -> Placement | None:
        ws = _prefillers(snap)
        return predicted_ttft(snap, self.rng.choice(ws), req) if ws else None

    def choose_decode(self, snap, req, ttft_s):
        ws = _decoders(snap)
        if not ws:
            return None
        w = self.rng.choice(ws)
        return Placement(w.id, predicted_tbt(w, ttft_s))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = {"prefill": 0, "decode": 0}

    def _next(self, side: str, ws: list[WorkerView]) -> WorkerView:
        w = ws[self.turn[side] % len(ws)]
        self.turn[side] += 1
        return w

    def choose_prefill(self, snap: ClusterSnapshot, req: RequestInfo) -> Placement | None:
        ws = _prefillers(snap)
        return predicted_ttft(snap, self._next("prefill", ws), req) if ws else None

    def choose_decode(self, snap, req, ttft_s):
        ws = _decoders(snap)
        if not ws:
            return None
        w = self._next("decode", ws)
        return Placement(w.id, predicted_tbt(w, ttft_s))


class LeastLoadPolicy(Policy):
    """Fewest queued prefill tokens (then fewest running requests); decode: fewest requests."""

    name = "least_load"

    def choose_prefill(self, snap: ClusterSnapshot, req: RequestInfo) -> Placement | None:
        ws = _prefillers(snap)
        if not ws:
            return None
        w = min(ws, key=lambda w: (w.load.queued_prefill_tokens + w.load.inflight, w.load.running))
        return predicted_ttft(snap, w, req)

    def choose_decode(self, snap, req, ttft_s):
        ws = _decoders(snap)
        if not ws:
            return None
        w = min(ws, key=lambda w: w.load.running + w.load.inflight)  # ties: the first by id
        return Placement(w.id, predicted_tbt(w, ttft_s))
