"""The offline API, named as vLLM's so that users' scripts port: ``LLM`` and ``generate``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from tqdm import tqdm

from kvpool.config import EngineConfig
from kvpool.engine.connectors.base import KVConnector
from kvpool.engine.llm_engine import LLMEngine
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict


class LLM:
    """Offline batched generation.

    ``LLM(model=None, dtype="float32", **config)`` where config is any :class:`EngineConfig`
    field (``kv_cache_memory_bytes``, ``block_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``enable_prefix_caching``, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "float32",
        connector: KVConnector | None = None,
        **config,
    ) -> None:
        loaded = config.pop("loaded_model", None)
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **config), loaded, connector)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are text or lists of token ids
        (or vLLM-style ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}`` dicts)."""
        items = self._as_list(prompts)
        params = self._params_for(items, sampling_params)
        ids = []
        for prompt, p in zip(items, params, strict=True):
            rid = str(self._counter)
            self._counter += 1
            self.engine.add_request(rid, self._unwrap(prompt), p)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them), generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [
            tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt))
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str | dict):
            return [prompts]
        if prompts and isinstance(prompts[0], int):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)

    @staticmethod
    def _unwrap(prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            return prompt["prompt"]
        return prompt

    @staticmethod
    def _params_for(items: list, sp) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in items]
        if isinstance(sp, SamplingParams):
            return [sp] * len(items)
        if len(sp) != len(items):
            raise ValueError("need one SamplingParams per prompt")
        return list(sp)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        t0 = time.perf_counter()
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        logger.debug("generated %d requests in %.2fs", len(ids), time.perf_counter() - t0)
        return [done[i] for i in ids]
