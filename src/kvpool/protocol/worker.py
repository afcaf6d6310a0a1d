"""What a worker reports about itself (the ``status`` RPC), typed: encoded and checked only at
the edges (``to_wire`` on the worker, ``from_wire`` in the conductor)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.errors import ProtocolError


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

KV_EVENT_KINDS = ("stored", "removed")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(f"malformed worker status: {what}")


@dataclass(slots=True, frozen=True)
class KVEvent:
    """A change of an engine's prefix cache (vLLM's KV events): a block hash became servable
    (``stored``) or stopped being (``removed``); ``seq`` numbers them per engine."""

    seq: int
    kind: str
    block_hash: bytes

    def to_wire(self) -> list:
        return [self.seq, self.kind, self.block_hash.hex()]

    @classmethod
    def from_wire(cls, w: object) -> KVEvent:
        _need(isinstance(w, list | tuple) and len(w) == 3, f"event {w!r}")
        seq, kind, h = w  # type: ignore[misc]
        _need(isinstance(seq, int) and kind in KV_EVENT_KINDS and isinstance(h, str),
              f"event {w!r}")  # fmt: skip
        return cls(seq, kind, _hex(h))


def _hex(h: object) -> bytes:
    try:
        return bytes.fromhex(h)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ProtocolError(f"malformed worker status: block hash {h!r}") from None


@dataclass(slots=True, frozen=True)
class WorkerStatus:
    """A worker's answer to ``status(since)``: who it is, its engine's KV format, its load (as
    the engine published it), its step-cost model, its counters, and its prefix cache as the
    KV events after ``since`` (or, when those are gone or ``since`` is 0, a ``snapshot`` of
    every cached hash). ``event_seq``: the newest event covered."""

    id: str
    role: str
    http: str
    rpc: str
    model: str
    pid: int
    alive: bool
    namespace: str
    block_size: int
    block_bytes: int
    max_model_len: int
    vocab_size: int
    load: EngineStatus
    cost: CostModel
    counters: dict
    event_seq: int
    events: tuple[KVEvent, ...] = ()
    snapshot: tuple[bytes, ...] | None = None
    step_tokens: int = 0  # tokens its engine steps at most (decode rows included; 0: unknown)

    def to_wire(self) -> dict:
        out = {f: getattr(self, f) for f in _PLAIN}
        out["step_tokens"] = self.step_tokens
        out["load"] = self.load.load_dict()
        out["cost"] = self.cost.to_dict()
        out["events"] = [e.to_wire() for e in self.events]
        if self.snapshot is not None:
            out["snapshot"] = [h.hex() for h in self.snapshot]
        return out

    @classmethod
    def from_wire(cls, d: object) -> WorkerStatus:
        """Decode and check one status (``ProtocolError`` if anything is missing or off)."""
        _need(isinstance(d, dict), "not a mapping")
        assert isinstance(d, dict)
        for f, kind in _PLAIN.items():
            _need(isinstance(d.get(f), kind), f"{f}={d.get(f)!r}")
        ld = d.get("load")
        _need(isinstance(ld, dict), "load")
        try:
            load = EngineStatus(0, int(ld["queued_prefill_tokens"]), int(ld["running"]),
                                int(ld["waiting"]), int(ld.get("loading", 0)),
                                float(ld["kv_usage"]),
                                tuple(int(x) for x in ld.get("remaining_tokens", ())))  # fmt: skip
            cost = CostModel.from_dict(d.get("cost") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed worker status: load or cost: {exc}") from None
        events = d.get("events", [])
        _need(isinstance(events, list), "events")
        snap = d.get("snapshot")
        _need(snap is None or isinstance(snap, list), "snapshot")
        step = d.get("step_tokens", 0)  # absent from older workers
        _need(type(step) is int and step >= 0, f"step_tokens={step!r}")
        return cls(**{f: d[f] for f in _PLAIN}, load=load, cost=cost,
                   events=tuple(KVEvent.from_wire(e) for e in events),
                   snapshot=None if snap is None else tuple(_hex(h) for h in snap),
                   step_tokens=step)  # fmt: skip


_PLAIN = {"id": str, "role": str, "http": str, "rpc": str, "model": str, "pid": int,
          "alive": bool, "namespace": str, "block_size": int, "block_bytes": int,
          "max_model_len": int, "vocab_size": int, "counters": dict, "event_seq": int}  # fmt: skip
