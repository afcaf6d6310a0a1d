"""Turns a scheduled batch into one forward pass over the paged KV cache, then samples.

Besides one token per completing chunk, a step gives ``n`` tokens for a request about to fork
into ``n`` sequences (the same logits, each sequence's own generator), logprobs of the rows
whose requests ask (``params.logprobs``), and, for a chunk of a prompt whose logprobs are
asked (``params.prompt_logprobs``), the logprobs of the tokens after each of its positions.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import NamedTuple

import torch

from kvpool.engine.logprobs import PositionLogprobs, logprob_dicts, prompt_logprob_dicts
from kvpool.engine.request import Request
from kvpool.engine.sampling import sample
from kvpool.model.attention import AttentionMetadata, PrefillSeq
from kvpool.model.llama import LlamaModel

logger = logging.getLogger(__name__)


class ScheduledChunk(NamedTuple):
    """``num_tokens`` tokens of ``request`` to compute, starting at ``start`` (its computed)."""

    request: Request
    start: int
    num_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the request's last token (so a token is sampled)."""
        return self.start + self.num_tokens == self.request.num_tokens


class Sampled(NamedTuple):
    """What a completing chunk's last position gave: one token per sequence (``n`` when its
    request forks now, else 1) and, when asked, their logprobs."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] | None


class StepResult(NamedTuple):
    samples: list[Sampled]  # one per completing chunk, in chunk order
    # chunk index -> logprobs of the prompt tokens at its positions + 1, + 2, ...
    prompt_logprobs: dict[int, list[PositionLogprobs]]


class StepInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # row of the flat batch whose logits are sampled, per completing chunk


class ModelRunner:
    """Owns the model and the KV tensor; runs one engine step."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        block_size: int,
        kernels: ModuleType | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.kernels = kernels  # compiled paged-attention kernels, or None for gather + SDPA

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Flatten the chunks (decodes first, as the runner was given them) into model inputs."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        blocks: list[torch.Tensor] = []
        prefills: list[PrefillSeq] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        sample_rows: list[int] = []
        for ch in chunks:
            req, start, n = ch
            row = len(ids)
            ids.extend(req.token_ids[start : start + n])
            end = start + n
            table = torch.tensor(req.block_ids[: -(-end // bs)], dtype=torch.long)
            p = torch.arange(start, end)
            pos.append(p)
            blocks.append(table[p // bs])
            if n == 1:
                assert not prefills, "decodes must come first"
                decode_tables.append(req.block_ids[: -(-end // bs)])
                decode_lens.append(end)
            else:
                mask = None
                if start > 0:
                    mask = torch.arange(end).unsqueeze(0) <= p.unsqueeze(1)
                prefills.append(PrefillSeq(row, row + n, start, table, mask))
            if ch.completes:
                sample_rows.append(row + n - 1)
        positions = torch.cat(pos)
        meta = AttentionMetadata(
            slot_blocks=torch.cat(blocks),
            slot_offsets=positions % bs,
            num_decodes=len(decode_lens),
            decode_block_table=None,
            decode_lens=None,
            decode_mask=None,
            prefills=prefills,
            kernels=self.kernels,
        )
        if decode_lens:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_table = torch.tensor(
                [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long
            )
            lens = torch.tensor(decode_lens, dtype=torch.long)
            meta.decode_lens = lens
            if self.kernels is None:
                meta.decode_mask = (torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1))[
                    :, None, None, :
                ]
        return StepInputs(torch.tensor(ids, dtype=torch.long), positions, meta, sample_rows)

    @torch.inference_mode()
    def execute(
        self, chunks: list[ScheduledChunk], copies: list[tuple[int, int]] = ()
    ) -> StepResult:
        """Copy blocks (copy-on-write of shared ones: ``(src, dst)``), run the step, sample."""
        inp = self.prepare(chunks)
        if copies:
            src, dst = (torch.tensor(x, dtype=torch.long) for x in zip(*copies, strict=True))
            self.kv_cache[dst] = self.kv_cache[src]
        hidden = self.model.forward(inp.input_ids, inp.positions, inp.meta, self.kv_cache)
        prompt_lps = self._prompt_logprobs(chunks, hidden)
        if not inp.sample_rows:
            return StepResult([], prompt_lps)
        # a prompt's first token is sampled from the same float32 head as its prompt logprobs
        logits = self.model.logits(hidden[inp.sample_rows], prompt=bool(inp.meta.prefills))
        done = [ch.request for ch in chunks if ch.completes]
        return StepResult(self._sample(logits, done), prompt_lps)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[Sampled]:
        widths = [r.params.n if r.fork_pending else 1 for r in reqs]
        params, gens = [], []
        for r, w in zip(reqs, widths, strict=True):
            params += [r.params] * w
            gens += [r.generator, *r.fork_generators[: w - 1]]
        if len(params) > len(reqs):  # a request forks: its row, once per sequence
            logits = logits[torch.repeat_interleave(torch.arange(len(reqs)),
                                                    torch.tensor(widths))]  # fmt: skip
        tokens = sample(logits, params, gens)
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        lps: list[PositionLogprobs | None] = [None] * len(tokens)
        if asked:
            got = logprob_dicts(logits[asked], [tokens[i] for i in asked],
                                [params[i].logprobs or 0 for i in asked])  # fmt: skip
            for i, d in zip(asked, got, strict=True):
                lps[i] = d
        out, at = [], 0
        for r, w in zip(reqs, widths, strict=True):
            lp = lps[at : at + w] if r.params.logprobs is not None else None
            out.append(Sampled(tokens[at : at + w], lp))  # type: ignore[arg-type]
            at += w
        return out

    def _prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden, prompt=True)

    def _prompt_logprobs(self, chunks: list[ScheduledChunk],
                         hidden: torch.Tensor) -> dict[int, list[PositionLogprobs]]:  # fmt: skip
        """For chunks of prompts whose logprobs are asked: position j's logits give the
        logprob of prompt token j + 1 (the prompt's last position is sampled instead)."""
        out: dict[int, list[PositionLogprobs]] = {}
        row = 0
        for i, (req, start, n) in enumerate(chunks):
            if req.needs_prompt_logprobs:
                end = min(start + n, req.num_prompt_tokens - 1)
                if end > start:
                    k = req.params.prompt_logprobs or 0
                    out[i] = prompt_logprob_dicts(self._prompt_logits,
                                                  hidden[row : row + end - start],
                                                  req.token_ids[start + 1 : end + 1], k)  # fmt: skip
            row += n
        return out
