"""Turns a scheduled batch into one forward pass over the paged KV cache, then samples."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import NamedTuple

import torch

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
    def execute(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Run the step; return one sampled token per completing chunk, in order."""
        inp = self.prepare(chunks)
        hidden = self.model.forward(inp.input_ids, inp.positions, inp.meta, self.kv_cache)
        if not inp.sample_rows:
            return []
        logits = self.model.logits(hidden[inp.sample_rows])
        done = [ch.request for ch in chunks if ch.completes]
        return sample(logits, [r.params for r in done], [r.generator for r in done])
