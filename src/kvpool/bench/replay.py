"""Replays scaled trace requests against an OpenAI-compatible endpoint, each at its time.

Requests go to ``/v1/completions`` as token-id prompts, streamed, greedy, with
``ignore_eos`` (servers that do not know it ignore it; actual output lengths are recorded
either way). ``prompt_format="text"`` sends text instead, for servers that only take text:
each trace block becomes a line of words derived from its token ids, and lines do not merge
under any usual pre-tokenizer, so equal blocks still tokenize alike. Concurrency and total
time are bounded; a progress bar shows sent, done, failed and rejected requests and rates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx

from kvpool.bench.metrics import RequestRecord
from kvpool.bench.trace import ScaledRequest

logger = logging.getLogger(__name__)
_WORDS = ["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child",
    "world", "school", "state", "family", "student", "group", "country", "problem", "hand",
    "part", "place", "case", "week", "company", "system", "program", "question", "work",
    "government", "number", "night", "point", "home", "water", "room", "mother", "area",
    "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word",
    "business", "issue", "side", "kind", "head", "house", "service", "friend", "father",
    "power", "hour", "game", "line", "end", "member", "law", "car", "city", "name", "team",
    "minute", "idea", "kid", "body", "back", "parent", "face", "others", "level", "office",
    "door", "health", "art", "war", "history", "party", "result", "change", "morning",
    "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education"]  # fmt: skip


@dataclass(slots=True)
class ReplayConfig:
    endpoint: str  # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # default: the first of /v1/models
    prompt_format: str = "auto"  # tokens | text | auto (tokens if the server takes them)
    max_concurrency: int = 256
    request_timeout: float = 600.0
    budget_s: float = 3600.0  # the whole replay, then what is left is cancelled
    api_key: str | None = None
    block_tokens: int = 16  # for the text format: tokens per line
    progress: bool = True

    def __post_init__(self) -> None:
        if self.prompt_format not in ("tokens", "text", "auto"):
            raise ValueError("prompt_format must be 'tokens', 'text' or 'auto'")
        if self.max_concurrency < 1 or self.budget_s <= 0 or self.request_timeout <= 0:
            raise ValueError("max_concurrency, budget and timeouts must be positive")


def text_prompt(tokens: tuple[int, ...], block_tokens: int) -> str:
    """One line of words per block of ``block_tokens`` ids (same ids, same line)."""
    lines = []
    for i in range(0, len(tokens), block_tokens):
        lines.append(" ".join(_WORDS[t % len(_WORDS)] for t in tokens[i : i + block_tokens]))
    return "\n".join(lines)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.sent = self.done = self.failed = self.rejected = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="replay", unit="req", mininterval=1.0)

    def finish(self, rec: RequestRecord) -> None:
        self.done += rec.status == "ok"
        self.failed += rec.status == "error"
        self.rejected += rec.status == "rejected"
        if self.bar is not None:
            el = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(sent=self.sent, ok=self.done, failed=self.failed,
                                 rejected=self.rejected, req_s=f"{self.done / el:.2f}",
                                 refresh=False)  # fmt: skip
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def resolve_model(client: httpx.AsyncClient, cfg: ReplayConfig) -> str:
    if cfg.model:
        return cfg.model
    r = await client.get(f"{cfg.endpoint}/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def probe_format(client: httpx.AsyncClient, cfg: ReplayConfig, model: str) -> str:
    """``tokens`` if the server answers a token-id prompt, else ``text``."""
    body = {"model": model, "prompt": [1000, 1001, 1002], "max_tokens": 1}
    r = await client.post(f"{cfg.endpoint}/v1/completions", json=body, timeout=120)
    if r.status_code in (400, 422):
        logger.warning("the server refuses token-id prompts (%d); sending text", r.status_code)
        return "text"
    return "tokens"


async def send_one(client: httpx.AsyncClient, cfg: ReplayConfig, model: str,
                   req: ScaledRequest, rec: RequestRecord) -> None:  # fmt: skip
    prompt = list(req.prompt) if cfg.prompt_format == "tokens" else \
        text_prompt(req.prompt, cfg.block_tokens)  # fmt: skip
    body = {"model": model, "prompt": prompt, "max_tokens": req.output_length,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", f"{cfg.endpoint}/v1/completions", json=body,
                                 timeout=cfg.request_timeout) as resp:  # fmt: skip
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread())[:300].decode(errors="replace")
                rec.status = "rejected" if resp.status_code == 429 else "error"
                rec.error = text
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("error"):
                    rec.error = str(data["error"])[:300]
                    return
                if any(c.get("text") for c in data.get("choices", [])):
                    rec.token_times.append(time.perf_counter() - t0)
                    chunks += 1
                usage = data.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = int(details.get("cached_tokens") or 0)
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.status = "ok"
        rec.output_tokens = rec.output_tokens or chunks
        rec.prompt_tokens = rec.prompt_tokens or len(req.prompt)
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.end_s = time.perf_counter() - t0


async def replay(
    requests: list[ScaledRequest], cfg: ReplayConfig
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; records (in trace order) and the duration."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency)
    records = [RequestRecord(r.index, r.arrival_s, 0.0, expected_output=r.output_length)
               for r in requests]  # fmt: skip
    progress = _Progress(len(requests), cfg.progress)
    sem = asyncio.Semaphore(cfg.max_concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        model = await resolve_model(client, cfg)
        if cfg.prompt_format == "auto":
            cfg.prompt_format = await probe_format(client, cfg, model)
        start = time.perf_counter()

        async def run(req: ScaledRequest, rec: RequestRecord) -> None:
            delay = req.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                rec.sent_s = time.perf_counter() - start
                progress.sent += 1
                await send_one(client, cfg, model, req, rec)
            progress.finish(rec)

        tasks = [asyncio.create_task(run(q, r)) for q, r in zip(requests, records, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=cfg.budget_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    progress.close()
    for rec in records:
        if rec.status == "error" and not rec.error:
            rec.error = "not finished within the replay budget"
    if pending:
        logger.warning("%d requests cut off by the %.0fs budget", len(pending), cfg.budget_s)
    return records, duration
