"""One request's state while it moves through the simulated cluster, and what it became."""

from __future__ import annotations

from kvpool.sim.workload import SimRequest


class Job:
    """A routed request: where it goes, how far its prompt is, when its tokens came out, and
    what the conductor predicted for it (to compare with what happened)."""

    __slots__ = ("best_blocks", "computed_on", "decode_on", "done", "finish", "first_s",
                 "join", "loading", "looked_up", "pending_tokens", "predicted_blocks",
                 "predicted_ttft_s", "prefill_on", "req", "reused", "tail_s",
                 "truth_blocks")  # fmt: skip

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.prefill_on = ""  # the prefill worker the route named ("" if decode computes)
        self.decode_on = ""  # the decode (or colocated) worker
        self.computed_on = ""  # where the prompt was computed
        self.pending_tokens = 0  # what the conductor counts as queued on prefill_on
        self.looked_up = False  # prefix found (local cache, pool) when it reached the queue head
        self.loading = False
        self.reused = 0  # blocks not computed: the local prefix or loaded from the pool
        self.done = 0  # prompt tokens computed or reused
        self.first_s = -1.0  # the first token (end of prefill)
        self.tail_s = -1.0  # the second token, when the decode node computed the prompt's tail
        self.join = -1  # index of its first decode step on the decode node
        self.finish = -1.0  # the last token
        self.predicted_blocks = 0  # what the route expected to reuse
        self.truth_blocks = 0  # what the computing node could have reused at routing time
        self.best_blocks = 0  # the longest prefix any worker (or the pool) held then
        self.predicted_ttft_s = 0.0

    @property
    def prompt_left(self) -> int:
        return self.req.input_tokens - self.done

    @property
    def decode_tokens(self) -> int:
        """Tokens left for the decode batch (the prefill gave one, a tail step another)."""
        return self.req.output_tokens - 1 - (self.tail_s >= 0)


# why a request's realized prefix differs from the route's prediction
OUTCOMES = ("as_predicted", "fewer_stale_view", "fewer_evicted", "more_stale_view",
            "more_new_blocks")  # fmt: skip


def outcome(job: Job) -> str:
    """``stale_view``: the conductor's view of the worker's cache (as of its last poll) was
    already wrong when it routed; ``evicted``: the blocks were there when it routed and gone
    when the prefill started; ``new_blocks``: blocks computed elsewhere meanwhile."""
    got, want, truth = job.reused, job.predicted_blocks, job.truth_blocks
    if got == want:
        return "as_predicted"
    if got < want:
        return "fewer_stale_view" if truth < want else "fewer_evicted"
    return "more_stale_view" if truth > want else "more_new_blocks"
