"""What a prompt may be (no torch here: the conductor checks with the same words)."""

from __future__ import annotations

from kvpool.common.errors import BadRequestError


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, limit: int) -> None:
    """400 for a prompt (plus the requested output) the model can never hold: no retry helps."""
    if num_prompt_tokens == 0:
        raise BadRequestError("the prompt is empty", param="prompt")
    want = num_prompt_tokens + (max_tokens or 1)
    if num_prompt_tokens >= limit or want > limit:
        raise BadRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{want} tokens ({num_prompt_tokens} in the prompt, {want - num_prompt_tokens} "
            "in the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens" if num_prompt_tokens < limit else "prompt",
        )


def check_prompt_chars(num_chars: int, limit_tokens: int, max_token_chars: int) -> None:
    """400 for a text longer than ``limit_tokens`` tokens could cover, however it tokenizes
    (a token spells at most ``max_token_chars`` characters): rejected before tokenizing."""
    most = limit_tokens * max(1, max_token_chars) * 2  # x2: slack for normalizers
    if num_chars > most:
        raise BadRequestError(
            f"the prompt has {num_chars} characters: more than this model's maximum context "
            f"length of {limit_tokens} tokens can hold",
            param="prompt",
        )


def check_token_ids(ids: list, vocab_size: int, limit: int) -> None:
    """400 for token ids outside the vocabulary, or more of them than the context holds."""
    if len(ids) >= limit:
        check_context_length(len(ids), 1, limit)
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise BadRequestError(f"token ids must be integers in [0, {vocab_size})", param="prompt")
