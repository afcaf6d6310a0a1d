"""kvpool: a KVCache-centric, disaggregated LLM serving system."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvpool.engine.llm import LLM
    from kvpool.engine.request import CompletionOutput, RequestOutput
    from kvpool.engine.sampling import SamplingParams


def __getattr__(name: str):
    # Lazy, so that ``import kvpool`` (e.g. by the CLI) does not pull in torch.
    if name == "LLM":
        from kvpool.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvpool.engine.sampling import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from kvpool.engine import request

        return getattr(request, name)
    raise AttributeError(name)
