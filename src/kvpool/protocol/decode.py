"""The prefill-to-decode hand-off, typed: the KV handle a prefill returns, and the request the
conductor sends the decode worker (tokenized once, by the conductor).

A ``KVHandle`` says where a prompt's blocks sit in the prefill worker's registered KV tensor
(segment, owner, and per block: its index in the prompt, its block id there, its chain hash,
and the checksum the pool got for it). The decode worker reads them straight from there (one
copy, no master round trip) and checks each against its checksum: a block the prefill worker
has reused since (or a dead worker) is read from the pool instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.common.errors import ProtocolError

MAX_PROMPTS = 128  # prompts of one request (the OpenAI layer's limit: serving/protocol.py)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(f"malformed hand-off: {what}")


@dataclass(slots=True, frozen=True)
class HandleBlock:
    index: int  # block index in the prompt
    block_id: int  # where it is in the prefill worker's KV tensor
    block_hash: bytes
    checksum: int  # what the pool's integrity check gives for this block's object


@dataclass(slots=True, frozen=True)
class HandleTail:
    """The prompt's last, partial block (``tokens`` < block size): never pooled (it has no
    chain hash), read only straight from the prefill worker, so the decode worker computes
    just the answer's first token instead of the prompt's tail with it."""

    index: int  # block index in the prompt (the number of full blocks before it)
    block_id: int
    tokens: int  # prompt tokens it holds
    checksum: int  # of its object (header naming its tokens + payload), keyed by tail_key


@dataclass(slots=True, frozen=True)
class KVHandle:
    segment: str  # the prefill worker's registered KV tensor
    owner: str  # its transfer engine (a restarted worker is another owner)
    block_bytes: int
    blocks: tuple[HandleBlock, ...] = ()
    tail: HandleTail | None = None

    def by_index(self) -> dict[int, HandleBlock]:
        return {b.index: b for b in self.blocks}

    def to_wire(self) -> dict:
        t = self.tail
        return {"segment": self.segment, "owner": self.owner, "block_bytes": self.block_bytes,
                "blocks": [[b.index, b.block_id, b.block_hash.hex(), b.checksum]
                           for b in self.blocks],
                "tail": [t.index, t.block_id, t.tokens, t.checksum] if t else None}  # fmt: skip

    @classmethod
    def from_wire(cls, d: object) -> KVHandle:
        _need(isinstance(d, dict), "kv_handle is not a mapping")
        assert isinstance(d, dict)
        seg, owner, size, blocks = (d.get(k) for k in ("segment", "owner", "block_bytes",
                                                        "blocks"))  # fmt: skip
        _need(isinstance(seg, str) and 0 < len(seg) <= 255 and isinstance(owner, str),
              "kv_handle segment/owner")  # fmt: skip
        _need(isinstance(size, int) and size > 0 and isinstance(blocks, list), "kv_handle")
        out = []
        for b in blocks:  # type: ignore[union-attr]
            _need(isinstance(b, list) and len(b) == 4, f"kv_handle block {b!r}")
            index, block_id, h, checksum = b
            _need(all(isinstance(x, int) and x >= 0 for x in (index, block_id, checksum))
                  and isinstance(h, str), f"kv_handle block {b!r}")  # fmt: skip
            try:
                out.append(HandleBlock(index, block_id, bytes.fromhex(h), checksum))
            except ValueError:
                raise ProtocolError(f"malformed hand-off: block hash {h!r}") from None
        tail = d.get("tail")
        if tail is not None:
            _need(isinstance(tail, list) and len(tail) == 4
                  and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                          for x in tail) and tail[2] > 0, f"kv_handle tail {tail!r}")  # fmt: skip
            tail = HandleTail(*tail)
        return cls(seg, owner, size, tuple(out), tail)


@dataclass(slots=True)
class DecodeRequest:
    """What the conductor asks a decode worker for (``POST /internal/generate``)."""

    request_id: str
    kind: str  # "chat" | "completion": the OpenAI shape of the answer
    token_ids: list[int]
    params: dict  # the engine's SamplingParams fields (it builds and checks them)
    stream: bool = False
    include_usage: bool = False
    cached_tokens: int | None = None  # prompt tokens the prefill reused (reported as usage)
    kv_handle: KVHandle | None = None
    # the answer's first token, which the prefill worker produced and the conductor already
    # streamed (chunks with ``response_id`` and ``created``): the decode worker goes on from it
    first_token: int | None = None
    response_id: str | None = None
    created: int | None = None
    # a completions request with several prompts: the ones after ``token_ids`` (computed by
    # the decode worker itself); choices are numbered prompt-major
    more_token_ids: list[list[int]] = field(default_factory=list)
    echo: bool = False  # completions: the prompt before each answer
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone

    def to_wire(self) -> dict:
        return {"request_id": self.request_id, "kind": self.kind, "token_ids": self.token_ids,
                "params": self.params, "stream": self.stream,
                "include_usage": self.include_usage,
                "cached_tokens": self.cached_tokens,
                "kv_handle": self.kv_handle.to_wire() if self.kv_handle else None,
                "first_token": self.first_token, "response_id": self.response_id,
                "created": self.created, "more_token_ids": self.more_token_ids,
                "echo": self.echo, "prompt_only": self.prompt_only}  # fmt: skip

    @classmethod
    def from_wire(cls, d: object) -> DecodeRequest:
        _need(isinstance(d, dict), "not a mapping")
        assert isinstance(d, dict)
        rid, kind, ids, params = (d.get(k) for k in ("request_id", "kind", "token_ids",
                                                     "params"))  # fmt: skip
        _need(isinstance(rid, str) and 0 < len(rid) <= 256, "request_id")
        _need(kind in ("chat", "completion"), "kind")
        _need(isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids),
              "token_ids")  # fmt: skip
        _need(isinstance(params, dict) and all(isinstance(k, str) for k in params), "params")
        cached = d.get("cached_tokens")
        _need(cached is None or (isinstance(cached, int) and cached >= 0), "cached_tokens")
        handle = d.get("kv_handle")
        first, rsp, created = d.get("first_token"), d.get("response_id"), d.get("created")
        _need(first is None or (isinstance(first, int) and not isinstance(first, bool)
                                and first >= 0), "first_token")  # fmt: skip
        _need(first is None or bool(d.get("stream")), "first_token is for streams only")
        _need((first is None) == (rsp is None) == (created is None),
              "first_token, response_id and created go together")  # fmt: skip
        _need(rsp is None or (isinstance(rsp, str) and 0 < len(rsp) <= 256), "response_id")
        _need(created is None or (isinstance(created, int) and created >= 0), "created")
        more = d.get("more_token_ids") or []
        _need(isinstance(more, list) and len(more) < MAX_PROMPTS and all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in more),
            "more_token_ids")  # fmt: skip
        _need(not more or kind == "completion", "several prompts are for completions only")
        echo, prompt_only = d.get("echo", False), d.get("prompt_only", False)
        _need(isinstance(echo, bool) and isinstance(prompt_only, bool), "echo, prompt_only")
        _need(not prompt_only or echo, "prompt_only goes with echo")
        return cls(rid, kind, ids, params, bool(d.get("stream")), bool(d.get("include_usage")),
                   cached, None if handle is None else KVHandle.from_wire(handle),
                   first, rsp, created, more, echo, prompt_only)  # fmt: skip
