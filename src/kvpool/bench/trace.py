"""Mooncake-format traces: loading (with line-numbered errors) and scaling for small machines.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``
where ``hash_ids`` name chained 512-token prompt blocks (equal id at position i = equal prefix
up to the end of block i). Scaling keeps that sharing pattern: every id becomes a block of
``block_tokens`` token ids derived only from the id (and the seed), so equal ids give equal
blocks and different ids different ones; lengths shrink by ``block_tokens / 512``.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512


class TraceError(ValueError):
    """A trace that cannot be used (with the line numbers of what was wrong)."""


@dataclass(slots=True, frozen=True)
class TraceRequest:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True)
class LoadReport:
    requests: list[TraceRequest]
    errors: list[str] = field(default_factory=list)  # "line N: why"


def _check(obj: object) -> TraceRequest | str:
    if not isinstance(obj, dict):
        return "not a JSON object"
    missing = [
        k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj
    ]
    if missing:
        return f"missing {', '.join(missing)}"
    ts, n_in, n_out, ids = (
        obj["timestamp"],
        obj["input_length"],
        obj["output_length"],
        obj["hash_ids"],
    )
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0 or not math.isfinite(ts):
        return "timestamp must be a number >= 0"
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"{name} must be an integer >= 1"
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in ids):  # fmt: skip
        return "hash_ids must be a list of integers"
    if not ids:
        return "hash_ids is empty"
    return TraceRequest(0, float(ts), n_in, n_out, tuple(ids))


def load_trace(path: str | Path, strict: bool = False) -> LoadReport:
    """Read a JSONL trace. Bad lines are reported (``errors``) and skipped, or, with
    ``strict``, raise TraceError listing them. Requests come back sorted by timestamp."""
    report = LoadReport([])
    try:
        f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                got = _check(json.loads(line))
            except json.JSONDecodeError as exc:
                got = f"invalid JSON ({exc.msg})"
            if isinstance(got, str):
                report.errors.append(f"line {n}: {got}")
                continue
            report.requests.append(TraceRequest(n, got.timestamp_ms, got.input_length,
                                                got.output_length, got.hash_ids))  # fmt: skip
    if strict and report.errors:
        shown = "; ".join(report.errors[:10])
        raise TraceError(f"{path}: {len(report.errors)} malformed line(s): {shown}")
    if not report.requests:
        raise TraceError(f"{path}: no usable request ({len(report.errors)} malformed lines)")
    report.requests.sort(key=lambda r: (r.timestamp_ms, r.line))
    return report


@dataclass(slots=True)
class ScaleConfig:
    block_tokens: int = 16  # tokens per trace block after scaling (512 in the trace)
    time_scale: float = 1.0  # multiplies inter-arrival times
    rate: float | None = None  # instead: Poisson arrivals at this many requests/s
    max_input: int | None = None  # tokens, after scaling
    max_output: int | None = None
    limit: int | None = None  # first N requests
    window: float | None = None  # or: the first SECONDS of the trace (after time scaling)
    seed: int = 0
    vocab: tuple[int, int] = (1000, 30000)  # token ids drawn from [lo, hi)

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.time_scale <= 0 or (self.rate is not None and self.rate <= 0):
            raise ValueError("time_scale and rate must be > 0")
        for name in ("max_input", "max_output", "limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.vocab[0] < 0 or self.vocab[1] <= self.vocab[0]:
            raise ValueError("vocab must be a non-empty range of token ids")


@dataclass(slots=True, frozen=True)
class ScaledRequest:
    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    output_length: int
    hash_ids: tuple[int, ...]  # of the blocks the prompt uses (after the input cap)
    trace_line: int


def block_tokens_for(hash_id: int, n: int, cfg: ScaleConfig) -> np.ndarray:
    """The ``n`` token ids of trace block ``hash_id`` (a function of the id and seed only)."""
    digest = hashlib.blake2b(f"{cfg.seed}:{hash_id}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.integers(cfg.vocab[0], cfg.vocab[1], size=n, dtype=np.int64)


def scaled_input_length(r: TraceRequest, cfg: ScaleConfig) -> int:
    n = max(1, round(r.input_length * cfg.block_tokens / TRACE_BLOCK))
    n = min(n, len(r.hash_ids) * cfg.block_tokens)  # never beyond the named blocks
    return min(n, cfg.max_input) if cfg.max_input else n


def scaled_arrivals(
    requests: list[TraceRequest], cfg: ScaleConfig
) -> Iterator[tuple[int, TraceRequest, float, int, int]]:
    """Per request kept by ``cfg``: its index, the trace line, its arrival (s from the first
    one), its scaled prompt length and its scaled output length (tokens)."""
    reqs = requests[: cfg.limit] if cfg.limit else requests
    if not reqs:
        return
    t0 = reqs[0].timestamp_ms
    rng = random.Random(cfg.seed)
    clock = 0.0
    for i, r in enumerate(reqs):
        if cfg.rate is not None:
            if i:
                clock += rng.expovariate(cfg.rate)
            arrival = clock
        else:
            arrival = (r.timestamp_ms - t0) / 1000.0 * cfg.time_scale
        if cfg.window is not None and arrival > cfg.window:
            return
        n_out = max(1, round(r.output_length * cfg.block_tokens / TRACE_BLOCK))
        if cfg.max_output:
            n_out = min(n_out, cfg.max_output)
        yield i, r, arrival, scaled_input_length(r, cfg), n_out


def scale(requests: list[TraceRequest], cfg: ScaleConfig) -> list[ScaledRequest]:
    """Scaled requests with arrival times in seconds from the first one."""
    out: list[ScaledRequest] = []
    for i, r, arrival, n_in, n_out in scaled_arrivals(requests, cfg):
        ids = r.hash_ids[: math.ceil(n_in / cfg.block_tokens)]
        tokens = np.concatenate([block_tokens_for(h, cfg.block_tokens, cfg) for h in ids])
        out.append(ScaledRequest(i, arrival, tuple(int(t) for t in tokens[:n_in]), n_out, ids,
                                 r.line))  # fmt: skip
    return out


def prefix_hit_ratio_trace(requests: list[TraceRequest], max_tokens: int | None = None) -> float:
    """Share of prompt tokens in blocks an earlier request already had (infinite cache),
    on the original trace: a block is a hit if its id (a whole-prefix id) was seen before.
    ``max_tokens`` truncates every prompt first (an input cap, in trace tokens)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        length = min(r.input_length, max_tokens) if max_tokens else r.input_length
        for j, h in enumerate(r.hash_ids):
            size = min(TRACE_BLOCK, length - j * TRACE_BLOCK)
            if size <= 0:
                break
            total += size
            if h in seen:
                hit += size
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def prefix_hit_ratio_tokens(prompts: list[tuple[int, ...]], block_tokens: int) -> float:
    """The same measure on token prompts: chained blocks of ``block_tokens`` (the last may be
    partial, matched by its tokens and everything before it)."""
    seen: set[bytes] = set()
    hit = total = 0
    for p in prompts:
        chain = hashlib.blake2b(digest_size=16)
        arr = np.asarray(p, dtype="<i8")
        keys = []
        for j in range(0, len(arr), block_tokens):
            block = arr[j : j + block_tokens]
            chain.update(block.tobytes())
            key = chain.copy().digest()
            keys.append(key)
            total += len(block)
            if key in seen:
                hit += len(block)
        seen.update(keys)
    return hit / total if total else 0.0
