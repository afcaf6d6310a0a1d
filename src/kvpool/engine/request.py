"""A request's state inside the engine, and what the engine reports back (vLLM's shapes)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvpool.engine.logprobs import PositionLogprobs
from kvpool.engine.sampling import SamplingParams, make_generator, sequence_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prefix is being loaded
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic``) of one request, for TTFT / inter-token metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One sequence of a request (``index`` among its ``n``), as vLLM's."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per token, with ``params.logprobs``
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    # with ``params.prompt_logprobs``: one per prompt token, the first None (nothing before it)
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class Request:
    """One sequence of a generation request: its tokens, blocks and progress.

    A request with ``n`` > 1 is one such sequence (index 0, the parent) until its prompt is
    computed; then it forks (``fork``) into ``n`` sequences sharing the prompt's blocks, each
    sampling with its own generator (seed ``seed + index``). ``seqs`` lists the parent's
    sequences (itself first); a child points to its ``parent``.
    """

    __slots__ = (
        "block_hashes",
        "block_ids",
        "cumulative_logprob",
        "finish_reason",
        "fork_generators",
        "generator",
        "index",
        "kv_handle",
        "logprobs",
        "metrics",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_token_ids",
        "params",
        "parent",
        "prompt",
        "prompt_logprobs",
        "prompt_logprobs_done",
        "prompt_token_ids",
        "request_id",
        "seqs",
        "status",
        "stop_reason",
        "text",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.output_token_ids: list[int] = []
        self.params = params
        self.generator: torch.Generator | None = make_generator(params.seed)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set at first scheduling
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self.metrics = RequestMetrics(arrival_time or time.monotonic())
        self.kv_handle: object = None  # where another engine holds this prompt's KV (a hint)
        self.index = 0
        self.parent: Request | None = None
        self.seqs: list[Request] = [self]
        self.fork_generators = [make_generator(sequence_seed(params.seed, i))
                                for i in range(1, params.n)]  # fmt: skip
        self.logprobs: list[PositionLogprobs] | None = None
        self.cumulative_logprob: float | None = None
        if params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.prompt_logprobs_done = params.prompt_logprobs is None
        if not self.prompt_logprobs_done:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def fork_pending(self) -> bool:
        """Whether its next sample is the first of ``n`` > 1 sequences (not forked yet)."""
        return self.parent is None and len(self.seqs) < self.params.n

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the runner must still compute logprobs of its prompt (so its prompt must
        be computed here, not taken from a cache: cached positions have no logits)."""
        return not self.prompt_logprobs_done

    @property
    def group(self) -> Request:
        """The request this sequence belongs to (its parent, or itself)."""
        return self.parent or self

    def group_finished(self) -> bool:
        """Every sequence of the request has finished (a request that never forked: itself)."""
        if not self.is_finished and self.fork_pending:
            return False
        return all(s.is_finished for s in self.seqs)

    def fork(self, index: int, request_id: str) -> Request:
        """Sequence ``index`` of this request, at the end of its prompt (blocks: the caller's)."""
        assert self.fork_pending and not self.output_token_ids and 0 < index < self.params.n
        child = Request(request_id, self.prompt_token_ids, self.params, self.prompt,
                        self.metrics.arrival_time)  # fmt: skip
        child.index, child.parent = index, self
        child.seqs, child.fork_generators = [], []
        child.generator = self.fork_generators[index - 1]
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        child.prompt_logprobs, child.prompt_logprobs_done = None, True  # the parent's count
        self.seqs.append(child)
        return child

    def set_prompt_logprobs(self, first: int, values: list[PositionLogprobs]) -> None:
        """Logprobs of prompt tokens ``first``, ``first + 1``, ... (recomputed ones overwrite)."""
        assert self.prompt_logprobs is not None
        self.prompt_logprobs[first : first + len(values)] = values

    def append_token(self, token: int, logprobs: PositionLogprobs | None = None) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprobs[token].logprob

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )
