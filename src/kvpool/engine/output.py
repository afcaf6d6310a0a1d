"""Per-token output handling: detokenize, check stop conditions, build RequestOutputs."""

from __future__ import annotations

from kvpool.engine.logprobs import PositionLogprobs, TokenDecoder
from kvpool.engine.request import CompletionOutput, Request, RequestOutput
from kvpool.model.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    """Turns sampled tokens into text and decides when a request is done."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids or tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.token_text = TokenDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

    def start(self, req: Request) -> None:
        self._detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=req.params.skip_special_tokens
        )

    def append(self, req: Request, token: int, now: float,
               logprobs: PositionLogprobs | None = None) -> None:  # fmt: skip
        """Record one new token of ``req`` (and its logprobs, when asked) and set its finish
        reason if it should stop."""
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        elif m.last_token_time is not None:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        if logprobs is not None:
            self.token_text.fill([logprobs])
        req.append_token(token, logprobs)
        p = req.params
        n_out = len(req.output_token_ids)
        may_stop = n_out >= p.min_tokens
        if may_stop and not p.ignore_eos and token in self.eos:
            req.finish_reason = "stop"
        elif may_stop and token in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        else:
            delta = self._detok[req.request_id].push([token])
            req.text += delta
            if may_stop and p.stop_strings and delta:
                self._check_stop_strings(req, len(delta))
        if req.finish_reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens)
            or req.num_tokens >= self.max_model_len
        ):
            req.finish_reason = "length"
        if req.finish_reason is not None:
            m.finished_time = now
            detok = self._detok.pop(req.request_id, None)
            if detok is not None and not isinstance(req.stop_reason, str):
                req.text += detok.finish()  # a held-back partial character, if any

    def _check_stop_strings(self, req: Request, delta_len: int) -> None:
        text = req.text
        longest = max(len(s) for s in req.params.stop_strings)
        begin = max(0, len(text) - delta_len - longest + 1)
        best: tuple[int, str] | None = None
        for s in req.params.stop_strings:
            i = text.find(s, begin)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return
        i, s = best
        req.text = text[: i + len(s)] if req.params.include_stop_str_in_output else text[:i]
        req.finish_reason, req.stop_reason = "stop", s

    def make_output(self, req: Request) -> RequestOutput:
        """The request's cumulative output: one ``CompletionOutput`` per sequence (``n``;
        sequences not forked yet are empty, with the parent's finish reason if it ended)."""
        assert req.parent is None
        for seq in req.seqs:
            if seq.finish_reason is not None:
                self._detok.pop(seq.request_id, None)
        outs = [_completion(s) for s in req.seqs]
        outs += [CompletionOutput(i, "", [], req.finish_reason, None,
                                  [] if req.logprobs is not None else None)
                 for i in range(len(outs), req.params.n)]  # fmt: skip
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=req.group_finished(),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=req.metrics,
            prompt_logprobs=req.prompt_logprobs if req.prompt_logprobs_done else None,
        )

    def prompt_computed(self, req: Request) -> None:
        """``req``'s whole prompt has been computed: its prompt logprobs (if asked) are final."""
        if not req.prompt_logprobs_done:
            req.prompt_logprobs_done = True
            self.token_text.fill(req.prompt_logprobs or [])


def _completion(seq: Request) -> CompletionOutput:
    lps = None if seq.logprobs is None else list(seq.logprobs)
    return CompletionOutput(seq.index, seq.text, list(seq.output_token_ids), seq.finish_reason,
                            seq.stop_reason, lps, seq.cumulative_logprob)  # fmt: skip
