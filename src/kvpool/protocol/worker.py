"""What a worker reports about itself that others plan with (its status carries these)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CostModel:
    """A worker's step time, fitted to its measured steps (least squares, refreshed often).

    prefill of ``n`` tokens: ``prefill_base_s + prefill_token_s * n``;
    one decode step with ``b`` running sequences: ``decode_base_s + decode_seq_s * b``.
    """

    prefill_base_s: float = 0.02
    prefill_token_s: float = 0.002
    decode_base_s: float = 0.03
    decode_seq_s: float = 0.002

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_base_s + self.prefill_token_s * max(tokens, 0) if tokens > 0 else 0.0

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_seq_s * max(batch, 1)

    def to_dict(self) -> dict:
        return {
            "prefill_base_s": self.prefill_base_s,
            "prefill_token_s": self.prefill_token_s,
            "decode_base_s": self.decode_base_s,
            "decode_seq_s": self.decode_seq_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(**{k: float(d[k]) for k in cls().to_dict() if k in d})


@dataclass(slots=True, frozen=True)
class EngineStatus:
    """What an engine's queues look like after a step: published by the engine thread (a new
    object each step, never changed), read by anyone (the worker's control RPC) without
    touching the live queues."""

    step: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens admitted or waiting, not yet computed
    running: int = 0
    waiting: int = 0  # including requests whose prefix is loading
    loading: int = 0  # of which waiting for their prefix from the pool
    kv_usage: float = 0.0
    remaining_tokens: tuple[int, ...] = ()  # per running request (at most MAX_REMAINING)

    def load_dict(self) -> dict:
        return {"queued_prefill_tokens": self.queued_prefill_tokens, "running": self.running,
                "waiting": self.waiting, "loading": self.loading, "kv_usage": self.kv_usage,
                "remaining_tokens": list(self.remaining_tokens)}  # fmt: skip


MAX_REMAINING = 256
