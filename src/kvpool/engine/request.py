"""A request's state inside the engine, and what the engine reports back (vLLM's shapes)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvpool.engine.sampling import SamplingParams, make_generator


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
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None

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


class Request:
    """One generation request: its tokens, blocks and progress."""

    __slots__ = (
        "block_hashes",
        "block_ids",
        "finish_reason",
        "generator",
        "kv_handle",
        "metrics",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_token_ids",
        "params",
        "prompt",
        "prompt_token_ids",
        "request_id",
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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )
